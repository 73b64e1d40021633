// The activations of a gated MLP, act(gate), for 16 float32 lanes (included with
// #include "servelm_activation.h"): SiLU and GELU-tanh as servelm/model/layers/fused_ops.cpp computes
// them (its act_and_mul) and as the rows kernel's fused gate_up epilogue does (gguf_rows.cpp
// ``rows_act``): one copy of the code, so that both give the same bits. That holds only where both are
// compiled alike: -ffp-contract=off (no multiply-add is contracted here: each is written out) and the
// same ISA where it matters (GELU-tanh's reciprocal path needs __FMA__).
#pragma once

#include <cstdint>

#include "servelm_simd.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace servelm_activation {

constexpr float kGeluBeta = 0.7978845608028654f;   // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

#ifdef __AVX512F__
// e^x for 16 float32 lanes (fused_ops.cpp's scalar exp_poly, lane by lane: a Cephes-style polynomial, x
// clamped to [-87, 88]; about 2 float ulps).
inline __m512 exp_poly16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// act(g) for 16 lanes: KIND 0 SiLU g / (1 + e^-g), 1 GELU tanh (0.5 g) (1 + tanh(beta (g + kappa g^3)))
template <int KIND>
inline __m512 activate16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (KIND == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), g3)));
  const __m512i sign_bit = _mm512_set1_epi32(int32_t(0x80000000u));
  const __m512i u_bits = _mm512_castps_si512(u);
  const __m512 abs_u = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, u_bits));
#ifdef __FMA__
  // e^(2|u|) as 2^(2|u| log2 e) (clamped at 2^64, where tanh is 1 in float32): n + f, a degree-6
  // polynomial of 2^f and scalef; 2 / (e + 1) by rcp14 and one Newton step instead of a division:
  // 2x the throughput of exp_poly16 + vdivps (0.72 -> 0.37 ns per element, one thread).
  const __m512 x = _mm512_min_ps(_mm512_mul_ps(abs_u, _mm512_set1_ps(2.f * 1.44269504088896341f)), _mm512_set1_ps(64.f));
  const __m512 den = _mm512_add_ps(servelm_simd::exp2_16(x), one);
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  const __m512 t = _mm512_fnmadd_ps(_mm512_set1_ps(2.f), inv, one);
#else
  const __m512 e = exp_poly16(_mm512_add_ps(abs_u, abs_u));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
#endif
  const __m512 tanh_u = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(u_bits, sign_bit)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh_u));
}
#endif  // __AVX512F__

#if defined(__AVX2__) && !defined(__AVX512F__)
// The AVX2 builds' 8 lanes: each lane is fused_ops.cpp's scalar float (exp_poly, activate<0> and <1>),
// its operations in their order. Built with or without FMA contraction alike: every product that an add
// or subtract takes is rounded first (``rounded8``); max/min take the constant first, so a NaN passes as
// std::max/min pass it.

// a product rounded to float32 before anything takes it: the empty asm keeps the compiler from fusing it
// into an FMA with a following add
inline __m256 rounded8(__m256 product) {
  asm("" : "+x"(product));
  return product;
}

inline __m256 exp_poly8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(rounded8(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f))),
                                                 _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, rounded8(_mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))));
  r = _mm256_sub_ps(r, rounded8(_mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f))));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(rounded8(_mm256_mul_ps(p, r)), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(rounded8(_mm256_mul_ps(p, r)), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(rounded8(_mm256_mul_ps(p, r)), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(rounded8(_mm256_mul_ps(p, r)), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(rounded8(_mm256_mul_ps(p, r)), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(rounded8(_mm256_mul_ps(p, _mm256_mul_ps(r, r))), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return rounded8(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

// act(g) for 8 lanes: KIND 0 SiLU g / (1 + e^-g) (-g by the sign bit, as unary minus flips it), 1 GELU
// tanh (0.5 g) (1 + tanh(beta (g + kappa g^3))) with tanh(u) = sign(u) (1 - 2 / (e^(2|u|) + 1))
template <int KIND>
inline __m256 activate8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  if (KIND == 0) return _mm256_div_ps(g, _mm256_add_ps(one, exp_poly8(_mm256_xor_ps(g, sign))));
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta),
                                 _mm256_add_ps(g, rounded8(_mm256_mul_ps(_mm256_set1_ps(kGeluKappa), g3))));
  const __m256 abs_u = _mm256_andnot_ps(sign, u);
  const __m256 e = exp_poly8(_mm256_mul_ps(_mm256_set1_ps(2.f), abs_u));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  const __m256 tanh_u = _mm256_or_ps(_mm256_andnot_ps(sign, t), _mm256_and_ps(u, sign));
  return _mm256_mul_ps(rounded8(_mm256_mul_ps(_mm256_set1_ps(0.5f), g)), _mm256_add_ps(one, tanh_u));
}
#endif  // AVX2 without AVX-512

}  // namespace servelm_activation
