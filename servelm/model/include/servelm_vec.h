// The float32 vector layer of servelm's kernels that are written once for two builds (included with
// #include "servelm_vec.h"): compiled with -mavx512f a vector ``vec::F`` is 16 lanes (zmm), with -mavx2
// -mfma and no AVX-512 (AMD Zen 1-3, most desktops and laptops) 8 lanes (ymm). A kernel written over
// ``vec`` and ``kLanes`` differs between its builds only in these functions and its register tiles' sizes.
// cpp_kernel.py hashes this header into every kernel's build key (see servelm_simd.h). Used by
// paged_decode.cpp and prefill_attention_f32.cpp.
#pragma once

#include <immintrin.h>
#include <cstdint>

namespace servelm_vec {

// The vector layer: F (kLanes float32 lanes) and the few operations the kernels use. The ones both
// widths spell alike (_mm512_add_ps, _mm256_add_ps) are written once, for the prefix P.
#define SERVELM_VEC_COMMON(P, VECTOR, LANES, ISA)                     \
  using F = VECTOR;                                                   \
  constexpr int kLanes = LANES;                                       \
  constexpr const char* kIsa = ISA;                                   \
  inline F zero() { return P##_setzero_ps(); }                        \
  inline F set1(float x) { return P##_set1_ps(x); }                   \
  inline F load(const float* x) { return P##_loadu_ps(x); }           \
  inline void store(float* x, F v) { P##_storeu_ps(x, v); }           \
  inline F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }     \
  inline F fnmadd(F a, F b, F c) { return P##_fnmadd_ps(a, b, c); }   \
  inline F mul(F a, F b) { return P##_mul_ps(a, b); }                 \
  inline F add(F a, F b) { return P##_add_ps(a, b); }                 \
  inline F sub(F a, F b) { return P##_sub_ps(a, b); }                 \
  inline F max(F a, F b) { return P##_max_ps(a, b); }

namespace vec {
#if defined(__AVX512F__)
SERVELM_VEC_COMMON(_mm512, __m512, 16, "avx512")
// bf16 is float32's top half: widened exactly.
inline F load(const uint16_t* x) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline float sum(F v) { return _mm512_reduce_add_ps(v); }
inline float max_lane(F v) { return _mm512_reduce_max_ps(v); }
inline F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n, n integral, rounded once.
inline F scale2(F p, F n) { return _mm512_scalef_ps(p, n); }
// 2^n for integral n in [-126, 127]: the exponent field.
inline F pow2(F n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// Lanes [0, count) of a tail (count < kLanes): their mask, a load (the others `fill`), a store.
using Tail = __mmask16;
inline Tail tail(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }
inline F load_tail(const float* x, Tail t, float fill) { return _mm512_mask_loadu_ps(set1(fill), t, x); }
inline void store_tail(float* x, Tail t, F v) { _mm512_mask_storeu_ps(x, t, v); }
inline F keep_tail(Tail t, F v) { return _mm512_maskz_mov_ps(t, v); }
// Lane masks of comparisons, and a blend by one (lanes where the mask is set take b).
using Mask = __mmask16;
inline Mask equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask less_equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline Mask greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask both(Mask a, Mask b) { return static_cast<Mask>(a & b); }
inline F blend(F a, F b, Mask m) { return _mm512_mask_blend_ps(m, a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
SERVELM_VEC_COMMON(_mm256, __m256, 8, "avx2")
inline F load(const uint16_t* x) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline float sum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float max_lane(F v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F pow2(F n) {   // 2^n for integral n in [-126, 127]: the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// p * 2^n for p in [0.5, 2] and integral n in [-149, 0] (exp's range here), rounded once as scalef:
// p * 2^max(n, -100) is exact (a normal number), then * 2^(n - that) rounds only into the subnormals.
inline F scale2(F p, F n) {
  const F high = max(n, set1(-100.0f));
  return mul(mul(p, pow2(high)), pow2(sub(n, high)));
}
using Tail = __m256i;
inline Tail tail(int64_t count) {
  static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - count));
}
inline F load_tail(const float* x, Tail t, float fill) {
  return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(x, t), _mm256_castsi256_ps(t));
}
inline void store_tail(float* x, Tail t, F v) { _mm256_maskstore_ps(x, t, v); }
inline F keep_tail(Tail t, F v) { return _mm256_and_ps(_mm256_castsi256_ps(t), v); }
using Mask = __m256;
inline Mask equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline Mask less_equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline Mask greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
inline F blend(F a, F b, Mask m) { return _mm256_blendv_ps(a, b, m); }
#else
#error "servelm_vec.h needs AVX-512F, or AVX2 and FMA"
#endif
}  // namespace vec

using vec::kLanes;

// e^r of x = n ln2 + r (|r| <= ln2 / 2), Cephes' expf polynomial (~1 ulp); n, integral, at *n. The exps
// below differ only in how they clamp x and scale by 2^n.
inline vec::F exp_parts(vec::F x, vec::F* n) {
  *n = vec::round(vec::mul(x, vec::set1(1.44269504088896341f)));
  vec::F r = vec::fnmadd(*n, vec::set1(0.693359375f), x);
  r = vec::fnmadd(*n, vec::set1(-2.12194440e-4f), r);
  vec::F p = vec::set1(1.9875691500e-4f);
  p = vec::fmadd(p, r, vec::set1(1.3981999507e-3f));
  p = vec::fmadd(p, r, vec::set1(8.3334519073e-3f));
  p = vec::fmadd(p, r, vec::set1(4.1665795894e-2f));
  p = vec::fmadd(p, r, vec::set1(1.6666665459e-1f));
  p = vec::fmadd(p, r, vec::set1(5.0000001201e-1f));
  return vec::fmadd(vec::mul(p, r), r, vec::add(r, vec::set1(1.0f)));
}

// exp of kLanes lanes (x <= 0 here: scores minus their maximum), as expf down to its subnormals: e^r
// times 2^n (scale2). std::exp per score (scalar, a call each) was a quarter of paged_decode.cpp's time
// at 32 streams x 164 columns. Each lane's value is the same in both builds.
inline vec::F exp_lanes(vec::F x) {
  vec::F n;
  const vec::F p = exp_parts(vec::max(x, vec::set1(-103.0f)), &n);   // below: 0 after scale2, as expf gives
  return vec::scale2(p, n);
}

// exp of x <= 0 with x clamped at -87, whose e^x is still a normal float: 2^n goes straight into the
// exponent field (pow2), one multiply instead of scale2's exact subnormal steps. Below -87 the result
// is e^-87 (~1.6e-38) instead of smaller, which a softmax's sum cannot tell (its maximum contributes 1).
inline vec::F exp_normal(vec::F x) {
  vec::F n;
  const vec::F p = exp_parts(vec::max(x, vec::set1(-87.0f)), &n);
  return vec::mul(p, vec::pow2(n));
}

}  // namespace servelm_vec
