// Small AVX-512 helpers shared by servelm's C++ kernels (included with #include "servelm_simd.h").
//
// servelm/model/cpp_kernel.py puts this directory on every kernel's include path and hashes every
// header in it into each kernel's build key, so editing a helper here rebuilds the kernels that may
// use it. Everything here needs only AVX-512F: a kernel compiled with at least -mavx512f may include
// it (without AVX-512F the header declares nothing). Each kernel compiles its own copy of these
// inline functions.
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

}  // namespace servelm_simd
#endif  // __AVX512F__
