// Small AVX-512 helpers shared by servelm's C++ kernels (included with #include "servelm_simd.h").
//
// servelm/model/cpp_kernel.py puts this directory on every kernel's include path and hashes every
// header in it into each kernel's build key, so editing a helper here rebuilds the kernels that may
// use it. Everything here needs only AVX-512F (``load_bias16`` also BW and VL, and is declared only
// with them): a kernel compiled with at least -mavx512f may include it (without AVX-512F the header
// declares nothing). Each kernel compiles its own copy of these inline functions.
#pragma once

#include <immintrin.h>
#include <cstdint>

#ifdef __AVX512F__
namespace servelm_simd {

// sum a[i] * b[i] over n float32 values (16 lanes at a time, a masked tail).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// 2^t for 16 float32 lanes: t = n + f (n the nearest integer, |f| <= 1/2), 2^f by its degree-6
// Taylor polynomial (relative error about 1e-7), scaled by 2^n with scalef (underflows to exactly 0).
// t = -inf gives NaN: callers zero masked lanes themselves.
inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// A GEMM's bias for outputs n0 .. n0 + 15 (``mask``: those that exist) as float32, from whichever of
// ``bias32`` (float32) and ``bias16`` (bf16, widened exactly) is set.
inline __m512 load_bias16(const float* bias32, const uint16_t* bias16, int64_t n0, __mmask16 mask) {
  if (bias32 != nullptr) return _mm512_maskz_loadu_ps(mask, bias32 + n0);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias16 + n0)), 16));
}
#endif

}  // namespace servelm_simd
#endif  // __AVX512F__
