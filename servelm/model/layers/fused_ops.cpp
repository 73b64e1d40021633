// Fused elementwise ops of a decoder layer, for any number of rows (decode steps and prefill chunks):
// RMSNorm (Llama's w * x and Gemma's (1 + w) * x) with the residual add before or after it, per-head
// q/k RMSNorm + RoPE in place, and act(gate) * up (SiLU, GELU tanh, GELU erf). At one row these ops
// are a few hundred floats each: torch's dispatch of the 3-7 ops each of them is made of costs more
// than the arithmetic, so one call per fused op is what pays. At a prefill chunk's rows each call
// reads its input and writes its output once, where torch's ops each write a temporary.
//
// Numerics follow the torch reference of servelm/model/layers/{norm,rotary,activation}.py step by step:
// float32 arithmetic, rounded to the activation dtype (float32 or bfloat16, round to nearest even as
// torch) wherever the reference rounds, no fused multiply-adds (built with -ffp-contract=off). What
// differs is the order of the sum of squares (16 partial sums) and exp (a Cephes-style polynomial,
// about 2 float ulps): results equal torch's to float32 rounding, and bf16 results are mostly bit-equal.
// The norms take x, the residual and the weight each in float32 or bfloat16 (a float32 residual stream
// beside bf16 activations and weights); every other op takes one dtype.
//
// Plain C++ that the compiler vectorizes; compiled at run time by servelm/model/layers/fused.py
// (with AVX-512 flags where the CPU has them). Rows are split over torch's threads only when there
// are many (a parallel region's fork and join costs more than a few rows of work).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "servelm_activation.h"
#include "servelm_simd.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kParallelElements = 1 << 16;   // below this many elements per call: one thread

struct F32 {
  using raw = float;
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
  static inline float round(float v) { return v; }
};

// bfloat16 as raw 16-bit words: float32's top half, rounded to nearest even (NaN kept quiet), as c10.
struct BF16 {
  using raw = uint16_t;
  static inline uint16_t to_bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return v != v ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
  static inline float from_bits(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  static inline float load(const uint16_t* p, int64_t i) { return from_bits(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float v) { p[i] = to_bits(v); }
  static inline float round(float v) { return from_bits(to_bits(v)); }
};

// 1 / sqrt(mean(x^2) + eps) of one row, float32, 16 partial sums.
template <class T>
inline float inv_rms(const typename T::raw* x, int64_t k, float eps) {
  float partial[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = T::load(x, i + j);
      partial[j] += v * v;
    }
  for (; i < k; ++i) {
    const float v = T::load(x, i);
    partial[i % 16] += v * v;
  }
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += partial[j];
  return 1.f / std::sqrt(sum / float(k) + eps);
}

// One normalised row of x (type N) into out (type O; out may be x where N is O), weight of type W:
// Gemma ((x * r) * (1 + w), rounded once to O) or Llama (w * round_N(x * r), rounded to O), as
// norm.py's reference does it.
template <class N, class W, class O>
inline void norm_row(const typename N::raw* x, const typename W::raw* w, typename O::raw* out, int64_t k,
                     float eps, bool offset) {
  const float r = inv_rms<N>(x, k, eps);
  if (offset) {
    for (int64_t i = 0; i < k; ++i) O::store(out, i, (N::load(x, i) * r) * (1.f + W::load(w, i)));
  } else {
    for (int64_t i = 0; i < k; ++i) O::store(out, i, W::load(w, i) * N::round(N::load(x, i) * r));
  }
}

template <class F>
void for_rows(int64_t rows, int64_t k, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelElements / std::max<int64_t>(k, 1));
  if (rows <= grain) {
    fn(0, rows);
  } else {
    at::parallel_for(0, rows, grain, fn);
  }
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              name, ": float32 or bfloat16");
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
              (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16),
              "weight: contiguous [K], float32 or bfloat16");
}

void check_residual(const torch::Tensor& residual, const torch::Tensor& x) {
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual: x's shape");
}

template <class Fn>
void dispatch(const torch::Tensor& x, const Fn& fn) {
  if (x.scalar_type() == torch::kFloat32) fn(F32());
  else fn(BF16());
}

// exp(x) for float32: Cephes' range reduction and degree-5 polynomial (about 2 ulps), branch-free so
// that loops over it vectorize; clamped to float's finite range (exp(-88) ~ 0 is what callers need).
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

using servelm_activation::kGeluBeta;
using servelm_activation::kGeluKappa;
#ifdef __AVX512F__
using servelm_activation::activate16;
using servelm_activation::exp_poly16;
#endif

// tanh(u) = sign(u) (1 - 2 / (e^(2|u|) + 1)): near +-1, where GELU's 1 + tanh(u) cancels, the small
// term is accurate to its own last bits, so the result is as close to float32 rounding as torch's.
inline float tanh_poly(float u) {
  const float t = 1.f - 2.f / (exp_poly(2.f * std::fabs(u)) + 1.f);
  return std::copysign(t, u);
}

// act(g) in float32 with torch's expression order: 0 SiLU g / (1 + e^-g); 1 GELU tanh
// (0.5 g) (1 + tanh(beta (g + kappa g^3))); 2 GELU erf.
template <int KIND>
inline float activate(float g) {
  if (KIND == 0) return g / (1.f + exp_poly(-g));
  if (KIND == 1) {
    const float u = kGeluBeta * (g + kGeluKappa * (g * g * g));
    return (0.5f * g) * (1.f + tanh_poly(u));
  }
  return 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f));
}

#ifdef __AVX512F__
// 16 lanes of float32 rounded to bf16 (nearest even, NaN quiet) as the top halves of 32-bit lanes.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
}

template <class T> struct Vec;
template <> struct Vec<F32> {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static __m512 round(__m512 v) { return v; }
};
template <> struct Vec<BF16> {
  static __m512 load(const uint16_t* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
#ifdef __AVX512BF16__
  // one vcvtneps2bf16: the same round to nearest even as bf16_bits16 (NaN stays a quiet NaN)
  static __m256i bits(__m512 v) {
    const __m256bh b = _mm512_cvtneps_pbh(v);
    return reinterpret_cast<const __m256i&>(b);
  }
  static void store(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits(v)); }
  static __m512 round(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits(v)), 16)); }
#else
  static void store(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
  }
  static __m512 round(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
#endif
};

#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// SiLU and GELU tanh of float32, 8 lanes at a time (AVX2 builds): servelm_activation.h's activate8, each
// lane this file's scalar float. GCC leaves the scalar loop scalar (floor, the int conversion, the
// division): SiLU * up of Qwen2.5 0.5B's 4864 columns took ~49 us a row, one thread.
using servelm_activation::activate8;
#endif

template <class T, int KIND>
void act_and_mul_impl(const torch::Tensor& gate_up, const torch::Tensor& out) {
  using raw = typename T::raw;
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  const raw* gp = reinterpret_cast<const raw*>(gate_up.data_ptr());
  raw* op = reinterpret_cast<raw*>(out.data_ptr());
  const int64_t gs = gate_up.stride(0);
  for_rows(rows, d, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const raw* g = gp + m * gs;
      const raw* u = g + d;
      raw* o = op + m * d;
      // round(round(act(g)) * u), as act(gate) then the multiply in the activation dtype
      int64_t i = 0;
#ifdef __AVX512F__
      if (KIND != 2) {
        for (; i + 16 <= d; i += 16) {
          const __m512 a = Vec<T>::round(activate16<KIND>(Vec<T>::load(g + i)));
          Vec<T>::store(o + i, _mm512_mul_ps(a, Vec<T>::load(u + i)));
        }
      }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
      if constexpr (KIND != 2 && std::is_same_v<T, F32>) {
        for (; i + 8 <= d; i += 8)
          _mm256_storeu_ps(o + i, _mm256_mul_ps(activate8<KIND>(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < d; ++i) T::store(o, i, T::round(activate<KIND>(T::load(g, i))) * T::load(u, i));
    }
  });
}

// Rope (rotate-half layout) of one head row in place, after an optional RMSNorm of it:
// out[i] = round(round(x[i] c[i]) + round(-x[i + h] s[i])), out[i + h] = round(round(x[i + h] c[i + h])
// + round(x[i] s[i + h])), as rotary.py's q * cos + rotate_half(q) * sin.
template <class T>
inline void norm_rope_row(typename T::raw* x, const typename T::raw* c, const typename T::raw* s,
                          const typename T::raw* w, float eps, bool offset, int64_t d, float* scratch) {
  if (w != nullptr) norm_row<T, T, T>(x, w, x, d, eps, offset);
  const int64_t h = d / 2;
  for (int64_t i = 0; i < d; ++i) scratch[i] = T::load(x, i);
  for (int64_t i = 0; i < h; ++i) {
    const float a = scratch[i], b = scratch[i + h];
    T::store(x, i, T::round(a * T::load(c, i)) + T::round(-b * T::load(s, i)));
    T::store(x, i + h, T::round(b * T::load(c, i + h)) + T::round(a * T::load(s, i + h)));
  }
}

#ifdef __AVX512F__
// norm_rope_row over every head of one token, 16 lanes at a time, for D a multiple of 32: the same
// floats (lane j of a head's sum of squares is partial[j], summed in the same order; every product and
// rounding as the scalar code, the normalised value rounded to T before the rotation as the scalar
// code's store and reload), in two passes over a head instead of three: the heads' sums of squares
// (4 heads' dependent-add chains interleaved), then norm + rotate + store. cos, sin and the norm weight
// (as 1 + w for Gemma's offset, else w) come as float32 rows, converted once per token, not per head.
template <class T>
struct NormRopeToken {
  using raw = typename T::raw;
  int64_t heads, hs, d;
  const float* w;   // nullptr: no norm
  float eps;
  bool offset;

  template <int R>
  void inv_rms(raw* x, float* r) const {
    __m512 acc[R];
    for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
      for (int j = 0; j < R; ++j) {
        const __m512 v = Vec<T>::load(x + j * hs + i);
        acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(v, v));
      }
    for (int j = 0; j < R; ++j) {
      alignas(64) float partial[16];
      _mm512_store_ps(partial, acc[j]);
      float sum = 0.f;
      for (int l = 0; l < 16; ++l) sum += partial[l];
      r[j] = 1.f / std::sqrt(sum / float(d) + eps);
    }
  }

  inline __m512 norm(__m512 v, __m512 r, const float* wi) const {
    const __m512 wv = _mm512_loadu_ps(wi);
    return Vec<T>::round(offset ? _mm512_mul_ps(_mm512_mul_ps(v, r), wv)
                                : _mm512_mul_ps(wv, Vec<T>::round(_mm512_mul_ps(v, r))));
  }

  void run(raw* x, const float* c, const float* s, float* r) const {
    if (w != nullptr) {
      int64_t head = 0;
      for (; head + 4 <= heads; head += 4) inv_rms<4>(x + head * hs, r + head);
      for (; head < heads; ++head) inv_rms<1>(x + head * hs, r + head);
    }
    const int64_t h = d / 2;
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t head = 0; head < heads; ++head) {
      raw* xh = x + head * hs;
      const __m512 rv = _mm512_set1_ps(w != nullptr ? r[head] : 1.f);
      for (int64_t i = 0; i < h; i += 16) {
        __m512 a = Vec<T>::load(xh + i), b = Vec<T>::load(xh + i + h);
        if (w != nullptr) {
          a = norm(a, rv, w + i);
          b = norm(b, rv, w + i + h);
        }
        const __m512 minus_b = _mm512_xor_ps(b, sign);
        Vec<T>::store(xh + i, _mm512_add_ps(Vec<T>::round(_mm512_mul_ps(a, _mm512_loadu_ps(c + i))),
                                            Vec<T>::round(_mm512_mul_ps(minus_b, _mm512_loadu_ps(s + i)))));
        Vec<T>::store(xh + i + h, _mm512_add_ps(Vec<T>::round(_mm512_mul_ps(b, _mm512_loadu_ps(c + i + h))),
                                                Vec<T>::round(_mm512_mul_ps(a, _mm512_loadu_ps(s + i + h)))));
      }
    }
  }
};
#endif

// Where rms_norm_impl's residual goes: none (norm(x)), after the norm (Gemma's post-norms:
// residual + norm(x)) or before it (Llama's pre-norm stream: norm(x + residual), x + residual).
enum class Add { kNone, kPost, kPre };

// The output's type: the residual's after a post-add, else the weight's.
template <Add ADD, class R, class W>
using NormOut = std::conditional_t<ADD == Add::kPost, R, W>;

#ifdef __AVX512F__
// Rows of rms_norm_impl, 16 lanes at a time, for K a multiple of 16: the same floats as the scalar
// path (lane j of a row's sum of squares is partial[j], summed in the same order; each product and
// rounding as norm_row), in two passes over a row instead of up to four (sum, norm, residual add).
// The sums of ROWS rows run interleaved: one row's 16-lane sum is a chain of dependent adds (K / 16 of
// them), ROWS rows keep ROWS chains in flight, so the first pass is throughput-bound, not latency-bound.
// X, R, W: the types of x, the residual and the weight (each float32 or bfloat16); O = NormOut.
// kPre: a row is round_R(x + residual), written to sum_out first, then normalised (Llama's pre-add);
// kPost: out = round_R(residual + round_R(norm(x))) (Gemma's post-add). Row m of x and the residual
// is at m * its stride, of sum_out and out at m * k.
template <Add ADD, class X, class R, class W>
struct NormRows {
  using O = NormOut<ADD, R, W>;
  const typename X::raw* x;
  const typename R::raw* residual;
  const typename W::raw* w;
  typename R::raw* sum_out;
  typename O::raw* out;
  int64_t xs, rs, k;
  float eps;
  bool offset;

  template <int ROWS>
  void run(int64_t m) const {
    __m512 acc[ROWS];
    for (int j = 0; j < ROWS; ++j) acc[j] = _mm512_setzero_ps();
    if constexpr (ADD == Add::kPre) {
      const typename R::raw* rows[ROWS];
      for (int64_t i = 0; i < k; i += 16)
        for (int j = 0; j < ROWS; ++j) {
          const __m512 v = Vec<R>::round(_mm512_add_ps(Vec<X>::load(x + (m + j) * xs + i),
                                                       Vec<R>::load(residual + (m + j) * rs + i)));
          Vec<R>::store(sum_out + (m + j) * k + i, v);
          acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(v, v));
        }
      for (int j = 0; j < ROWS; ++j) rows[j] = sum_out + (m + j) * k;
      normalise<R, ROWS>(rows, acc, m);
    } else {
      const typename X::raw* rows[ROWS];
      for (int j = 0; j < ROWS; ++j) rows[j] = x + (m + j) * xs;
      for (int64_t i = 0; i < k; i += 16)
        for (int j = 0; j < ROWS; ++j) {
          const __m512 v = Vec<X>::load(rows[j] + i);
          acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(v, v));
        }
      normalise<X, ROWS>(rows, acc, m);
    }
  }

  // The second pass: rows of type N (x, or the pre-add's sums) normalised with their sums of squares.
  template <class N, int ROWS>
  void normalise(const typename N::raw* const* rows, const __m512* acc, int64_t m) const {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int j = 0; j < ROWS; ++j) {
      alignas(64) float partial[16];
      _mm512_store_ps(partial, acc[j]);
      float sum = 0.f;
      for (int l = 0; l < 16; ++l) sum += partial[l];
      const __m512 r = _mm512_set1_ps(1.f / std::sqrt(sum / float(k) + eps));
      const typename N::raw* xr = rows[j];
      typename O::raw* o = out + (m + j) * k;
      for (int64_t i = 0; i < k; i += 16) {
        const __m512 v = Vec<N>::load(xr + i), wv = Vec<W>::load(w + i);
        __m512 y = offset ? _mm512_mul_ps(_mm512_mul_ps(v, r), _mm512_add_ps(one, wv))
                          : _mm512_mul_ps(wv, Vec<N>::round(_mm512_mul_ps(v, r)));
        if constexpr (ADD == Add::kPost) y = _mm512_add_ps(Vec<R>::load(residual + (m + j) * rs + i), Vec<O>::round(y));
        Vec<O>::store(o + i, y);
      }
    }
  }

  void rows_range(int64_t begin, int64_t end) const {
    int64_t m = begin;
    for (; m + 4 <= end; m += 4) run<4>(m);
    for (; m < end; ++m) run<1>(m);
  }
};
#endif

// norm(x) into out, with the residual add ADD (sum: the pre-add's x + residual). X, R, W: the types
// of x, residual and weight (R unused without a residual); out is NormOut's type.
template <Add ADD, class X, class R, class W>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& out, float eps,
                   bool offset, const torch::Tensor* residual, torch::Tensor* sum) {
  using O = NormOut<ADD, R, W>;
  using xraw = typename X::raw;
  using rraw = typename R::raw;
  using oraw = typename O::raw;
  const int64_t rows = x.size(0), k = x.size(1);
  const xraw* xp = reinterpret_cast<const xraw*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const typename W::raw*>(weight.data_ptr());
  oraw* op = reinterpret_cast<oraw*>(out.data_ptr());
  const rraw* rp = residual != nullptr ? reinterpret_cast<const rraw*>(residual->data_ptr()) : nullptr;
  rraw* sp = sum != nullptr ? reinterpret_cast<rraw*>(sum->data_ptr()) : nullptr;
  const int64_t xs = x.stride(0), rs = residual != nullptr ? residual->stride(0) : 0;
#ifdef __AVX512F__
  if (k % 16 == 0) {
    const NormRows<ADD, X, R, W> norm{xp, rp, wp, sp, op, xs, rs, k, eps, offset};
    for_rows(rows, k, [&](int64_t begin, int64_t end) { norm.rows_range(begin, end); });
    return;
  }
#endif
  for_rows(rows, k, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const xraw* xr = xp + m * xs;
      oraw* orow = op + m * k;
      if constexpr (ADD == Add::kPre) {   // sum = round_R(x + residual), out = norm(sum)
        rraw* srow = sp + m * k;
        const rraw* rr = rp + m * rs;
        for (int64_t i = 0; i < k; ++i) R::store(srow, i, X::load(xr, i) + R::load(rr, i));
        norm_row<R, W, O>(srow, wp, orow, k, eps, offset);
      } else if constexpr (ADD == Add::kPost) {   // out = round_R(residual + round_R(norm(x)))
        norm_row<X, W, O>(xr, wp, orow, k, eps, offset);
        const rraw* rr = rp + m * rs;
        for (int64_t i = 0; i < k; ++i) O::store(orow, i, R::load(rr, i) + O::load(orow, i));
      } else {
        norm_row<X, W, O>(xr, wp, orow, k, eps, offset);
      }
    }
  });
}

// rms_norm_impl for the tensors' types (every mix of float32 and bfloat16 is instantiated).
template <Add ADD>
void rms_norm_dispatch(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& out, float eps,
                       bool offset, const torch::Tensor* residual, torch::Tensor* sum) {
  dispatch(x, [&](auto xt) {
    dispatch(weight, [&](auto wt) {
      using X = decltype(xt);
      using W = decltype(wt);
      if constexpr (ADD == Add::kNone) {
        rms_norm_impl<ADD, X, X, W>(x, weight, out, eps, offset, nullptr, nullptr);
      } else {
        dispatch(*residual, [&](auto rt) {
          rms_norm_impl<ADD, X, decltype(rt), W>(x, weight, out, eps, offset, residual, sum);
        });
      }
    });
  });
}

// Heads of ``tokens`` rows in place: head h of row m at data + m * ts + h * hs, d elements each
// (contiguous). A [T, H, D] tensor's, or a span of a QKV projection's rows (norm_rope_qkv_).
struct HeadRows {
  void* data;
  int64_t tokens, heads, d, ts, hs;
};

HeadRows head_rows(const torch::Tensor& t) {
  return {t.data_ptr(), t.size(0), t.size(1), t.size(2), t.stride(0), t.stride(1)};
}

// The rows' heads normed (where wp is given) and rotated in place: cos and sin rows m at cp + m * cs and
// sp + m * ss, the norm weight at wp (or nullptr), all in T.
template <class T>
void rope_rows(const HeadRows& rows, const typename T::raw* cp, int64_t cs, const typename T::raw* sp, int64_t ss,
               const typename T::raw* wp, float eps, bool offset) {
  using raw = typename T::raw;
  const int64_t tokens = rows.tokens, heads = rows.heads, d = rows.d;
  raw* tp = reinterpret_cast<raw*>(rows.data);
  const int64_t ts = rows.ts, hs = rows.hs;
#ifdef __AVX512F__
  if (d % 32 == 0) {
    std::vector<float> weight_f(wp != nullptr ? d : 0);   // 1 + w (Gemma) or w, as the scalar code computes it
    for (int64_t i = 0; i < int64_t(weight_f.size()); ++i) weight_f[i] = offset ? 1.f + T::load(wp, i) : T::load(wp, i);
    const NormRopeToken<T> token{heads, hs, d, wp != nullptr ? weight_f.data() : nullptr, eps, offset};
    for_rows(tokens, heads * d, [&](int64_t begin, int64_t end) {
      std::vector<float> angles(2 * d), inv_rms(heads);   // this token's cos, sin as float32
      for (int64_t m = begin; m < end; ++m) {
        for (int64_t i = 0; i < d; ++i) {
          angles[i] = T::load(cp + m * cs, i);
          angles[d + i] = T::load(sp + m * ss, i);
        }
        token.run(tp + m * ts, angles.data(), angles.data() + d, inv_rms.data());
      }
    });
    return;
  }
#endif
  for_rows(tokens, heads * d, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(d);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t head = 0; head < heads; ++head) {
        norm_rope_row<T>(tp + m * ts + head * hs, cp + m * cs, sp + m * ss, wp, eps, offset, d, scratch.data());
      }
  });
}

template <class T>
void rope_impl(const HeadRows& rows, const torch::Tensor& cos, const torch::Tensor& sin,
               const c10::optional<torch::Tensor>& weight, float eps, bool offset) {
  using raw = typename T::raw;
  rope_rows<T>(rows, reinterpret_cast<const raw*>(cos.data_ptr()), cos.stride(0),
               reinterpret_cast<const raw*>(sin.data_ptr()), sin.stride(0),
               weight.has_value() ? reinterpret_cast<const raw*>(weight->data_ptr()) : nullptr, eps, offset);
}

// cos, sin [tokens, d] and the norm weight (if any) [d], in ``dtype``.
void check_rotation(const torch::Tensor& cos, const torch::Tensor& sin, const c10::optional<torch::Tensor>& weight,
                    int64_t tokens, int64_t d, c10::ScalarType dtype, const char* name) {
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.stride(1) == 1 && sin.stride(1) == 1 &&
              cos.size(0) == tokens && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos, sin: [T, D] with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "cos, sin in ", name, "'s dtype");
  if (weight.has_value()) {
    TORCH_CHECK(weight->dim() == 1 && weight->is_contiguous() && weight->size(0) == d &&
                weight->scalar_type() == dtype, name, " norm weight: contiguous [D] in its dtype");
  }
}

void check_heads(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin,
                 const c10::optional<torch::Tensor>& weight, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.size(2) % 2 == 0, name, ": [T, H, D] with contiguous heads, even D");
  check_rotation(cos, sin, weight, t.size(0), t.size(2), t.scalar_type(), name);
}

// Softmax of one tile's attention scores [G * n, C] (row r: query r % n of the tile, at position
// q_first + r % n; column c: key position k_first + c), each row over the keys it may see (causal,
// and inside the sliding window when window > 0), written to probs in its dtype with 0 elsewhere.
// As prefill_gemm.py's torch path: float32 from the scores' dtype, max, exp(x - max), sum, times
// 1 / sum, rounded once; the masked columns are the -inf bias's exact zeros.
template <class T>
void causal_softmax_impl(const torch::Tensor& scores, const torch::Tensor& probs, int64_t n, int64_t q_first,
                         int64_t k_first, int64_t window) {
  using raw = typename T::raw;
  const int64_t rows = scores.size(0), columns = scores.size(1), ss = scores.stride(0);
  const raw* sp = reinterpret_cast<const raw*>(scores.data_ptr());
  raw* pp = reinterpret_cast<raw*>(probs.data_ptr());
  for_rows(rows, columns, [&](int64_t begin, int64_t end) {
    std::vector<float> e(columns);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t position = q_first + r % n;
      const int64_t hi = std::min(columns, position - k_first + 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, position - window + 1 - k_first) : 0;
      const raw* s = sp + r * ss;
      raw* o = pp + r * columns;
      float top = -INFINITY;
      int64_t c = lo;
#ifdef __AVX512F__
      __m512 top_lanes = _mm512_set1_ps(-INFINITY);
      for (; c + 16 <= hi; c += 16) top_lanes = _mm512_max_ps(top_lanes, Vec<T>::load(s + c));
      top = _mm512_reduce_max_ps(top_lanes);
#endif
      for (; c < hi; ++c) top = std::max(top, T::load(s, c));
      float partial[16] = {0.f};
      c = lo;
#ifdef __AVX512F__
      __m512 acc = _mm512_setzero_ps();
      const __m512 top16 = _mm512_set1_ps(top);
      for (; c + 16 <= hi; c += 16) {
        const __m512 v = exp_poly16(_mm512_sub_ps(Vec<T>::load(s + c), top16));
        _mm512_storeu_ps(e.data() + c, v);
        acc = _mm512_add_ps(acc, v);
      }
      _mm512_storeu_ps(partial, acc);
#endif
      for (; c < hi; ++c) {
        e[c] = exp_poly(T::load(s, c) - top);
        partial[c % 16] += e[c];
      }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += partial[j];
      const float inverse = 1.f / sum;
      std::memset(o, 0, sizeof(raw) * lo);   // +0.0 is all zero bits in float32 and bfloat16
      c = lo;
#ifdef __AVX512F__
      const __m512 inverse16 = _mm512_set1_ps(inverse);
      for (; c + 16 <= hi; c += 16) Vec<T>::store(o + c, _mm512_mul_ps(_mm512_loadu_ps(e.data() + c), inverse16));
#endif
      for (; c < hi; ++c) T::store(o, c, e[c] * inverse);
      std::memset(o + hi, 0, sizeof(raw) * (columns - hi));
    }
  });
}

}  // namespace

// RMSNorm of x [M, K] (rows contiguous, any row stride) -> new contiguous [M, K] in the weight's dtype;
// with ``residual``: residual + norm(x) in the residual's dtype (the add after the norm, Gemma's
// post-norms; the norm rounded to that dtype first). x, residual and weight: float32 or bfloat16, any mix.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool offset,
                       c10::optional<torch::Tensor> residual) {
  check_norm(x, weight);
  if (residual.has_value()) check_residual(*residual, x);
  auto out = torch::empty(x.sizes(), x.options().dtype(residual.has_value() ? residual->scalar_type()
                                                                            : weight.scalar_type()));
  if (residual.has_value()) rms_norm_dispatch<Add::kPost>(x, weight, out, float(eps), offset, &*residual, nullptr);
  else rms_norm_dispatch<Add::kNone>(x, weight, out, float(eps), offset, nullptr, nullptr);
  return out;
}

// (norm(x + residual), x + residual): the add before the norm (Llama's pre-norm residual stream); the
// sum in the residual's dtype, the norm in the weight's.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                                        bool offset) {
  check_norm(x, weight);
  check_residual(residual, x);
  auto out = torch::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  auto sum = torch::empty(x.sizes(), x.options().dtype(residual.scalar_type()));
  rms_norm_dispatch<Add::kPre>(x, weight, out, float(eps), offset, &residual, &sum);
  return {out, sum};
}

// q [T, H, D], k [T, Hkv, D] rotated in place (after a per-head RMSNorm where a weight is given).
void norm_rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                c10::optional<torch::Tensor> q_weight, c10::optional<torch::Tensor> k_weight, double eps,
                bool offset) {
  check_heads(q, cos, sin, q_weight, "q");
  check_heads(k, cos, sin, k_weight, "k");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "q: float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.size(2) == q.size(2), "k like q");
  dispatch(q, [&](auto tag) {
    rope_impl<decltype(tag)>(head_rows(q), cos, sin, q_weight, float(eps), offset);
    rope_impl<decltype(tag)>(head_rows(k), cos, sin, k_weight, float(eps), offset);
  });
}

// norm_rope_ of the q and k heads of a QKV projection's rows qkv [T, (H + 2 Hkv) * D] (rows contiguous,
// any row stride: q's H heads, k's Hkv, then v's), in place, D = cos.size(1): the same floats as
// norm_rope_ on its q and k views, without building them (a one-row decode step's split and three
// views cost more than the rotation).
void norm_rope_qkv_(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, torch::Tensor cos, torch::Tensor sin,
                    c10::optional<torch::Tensor> q_weight, c10::optional<torch::Tensor> k_weight, double eps,
                    bool offset) {
  check_rows(qkv, "qkv");
  const int64_t d = cos.size(-1), tokens = qkv.size(0);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && d % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "qkv: [T, (H + 2 Hkv) * D], even D");
  check_rotation(cos, sin, q_weight, tokens, d, qkv.scalar_type(), "q");
  check_rotation(cos, sin, k_weight, tokens, d, qkv.scalar_type(), "k");
  dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    auto* base = reinterpret_cast<typename T::raw*>(qkv.data_ptr());
    const int64_t ts = qkv.stride(0);
    rope_impl<T>({base, tokens, num_heads, d, ts, d}, cos, sin, q_weight, float(eps), offset);
    rope_impl<T>({base + num_heads * d, tokens, num_kv_heads, d, ts, d}, cos, sin, k_weight, float(eps), offset);
  });
}

// act(gate) * up of gate_up [M, 2d] (rows contiguous) -> new [M, d]; kind 0 SiLU, 1 GELU tanh, 2 GELU erf.
torch::Tensor act_and_mul(torch::Tensor gate_up, int64_t kind) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: even width");
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 silu, 1 gelu tanh, 2 gelu");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    if (kind == 0) act_and_mul_impl<T, 0>(gate_up, out);
    else if (kind == 1) act_and_mul_impl<T, 1>(gate_up, out);
    else act_and_mul_impl<T, 2>(gate_up, out);
  });
  return out;
}

// Causal (and sliding-window, window > 0) softmax of a prefill tile's scores [G * n, C] (float32 or
// bfloat16) -> new [G * n, C] in their dtype; see causal_softmax_impl.
torch::Tensor causal_softmax(torch::Tensor scores, int64_t n, int64_t q_first, int64_t k_first, int64_t window) {
  check_rows(scores, "scores");
  TORCH_CHECK(n > 0 && scores.size(0) % n == 0, "scores: G * n rows");
  TORCH_CHECK(q_first >= k_first && q_first + n - 1 - k_first < scores.size(1),
              "every query's own key is a column");
  auto probs = torch::empty(scores.sizes(), scores.options());
  dispatch(scores, [&](auto tag) { causal_softmax_impl<decltype(tag)>(scores, probs, n, q_first, k_first, window); });
  return probs;
}

// The first index of each row's maximum of x [M, V] (float32, rows contiguous) -> int64 [M], as
// torch.argmax(dim=-1): ties to the lowest index, a row with a NaN gives its first NaN, a row of -inf
// gives 0. One pass for the maximum (and whether a NaN is there), then a scan from the start for the
// first element equal to it, 64 at a time; torch's argmax reduces each row with a scalar value-and-
// index loop, and the chunked torch path (sampling/argmax.py) is a dozen ops: at one row of a 152K
// vocabulary that dispatch cost more than the two passes.
torch::Tensor first_argmax(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.size(1) > 0, "x: float32 [M, V], V > 0");
  const int64_t rows = x.size(0), v = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(rows, v, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * stride;
      constexpr int kWidth = 16;
      float best[kWidth], nan[kWidth];
      for (int j = 0; j < kWidth; ++j) best[j] = -std::numeric_limits<float>::infinity(), nan[j] = 0.f;
      int64_t i = 0;
      for (; i + kWidth <= v; i += kWidth)
        for (int j = 0; j < kWidth; ++j) {
          const float value = row[i + j];
          best[j] = value > best[j] ? value : best[j];
          nan[j] += value != value ? 1.f : 0.f;
        }
      for (; i < v; ++i) {
        best[0] = row[i] > best[0] ? row[i] : best[0];
        nan[0] += row[i] != row[i] ? 1.f : 0.f;
      }
      float top = best[0], nans = nan[0];
      for (int j = 1; j < kWidth; ++j) top = best[j] > top ? best[j] : top, nans += nan[j];
      const bool want_nan = nans > 0.f;
      constexpr int64_t kChunk = 64;
      int64_t found = 0;
      for (int64_t start = 0; start < v; start += kChunk) {
        const int64_t stop = std::min(start + kChunk, v);
        bool hit = false;
        for (int64_t k = start; k < stop; ++k) hit |= want_nan ? row[k] != row[k] : row[k] == top;
        if (!hit) continue;
        for (int64_t k = start; k < stop; ++k)
          if (want_nan ? row[k] != row[k] : row[k] == top) { found = k; break; }
        break;
      }
      op[m] = found;
    }
  });
  return out;
}

// Rows ``ids`` [T] of a GGUF weight held as packed codes (gguf_blocks.PackedCodes: per 32 inputs, 16
// bytes of nibbles, byte j holding code j's low 4 bits and code j + 16's in its high nibble, then for
// 5 and 6 bits the codes' high bits as one little-endian integer of 4 or 8 bytes, code i's at bit
// 16 (i' % 2) + 8 h + i' / 2 (5 bits) or 16 (i' % 4) + 8 h + 2 (i' / 4) (6 bits), i' = i % 16,
// h = i / 16; ``centered``: the stored value is code + 2^(bits - 1)), dequantized as BlockRows does it
// in torch: float(code) * scale (+ offset), float32, each block of ``block`` inputs its scale and
// offset [N, K / block]. -> float32 [T, K]. An embedding lookup of one row was ~25 torch ops.
torch::Tensor packed_rows(torch::Tensor data, int64_t bits, bool centered, torch::Tensor ids, torch::Tensor scales,
                          c10::optional<torch::Tensor> offsets, int64_t block) {
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == torch::kUInt8, "data: contiguous uint8 [N, K * bits / 8]");
  TORCH_CHECK(bits >= 4 && bits <= 6, "bits: 4, 5 or 6");
  const int64_t n = data.size(0), step = 4 * bits, k = data.size(1) / step * 32;
  TORCH_CHECK(data.size(1) % step == 0 && block > 0 && k % block == 0, "K a multiple of 32 and of the block");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == torch::kInt64, "ids: contiguous int64 [T]");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
              scales.size(0) == n && scales.size(1) == k / block, "scales: contiguous float32 [N, K / block]");
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                offsets->scalar_type() == torch::kFloat32, "offsets: like scales");
  }
  const int64_t rows = ids.size(0);
  auto out = torch::empty({rows, k}, scales.options());
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* sp = scales.data_ptr<float>();
  const float* fp = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int32_t bias = centered ? (1 << (bits - 1)) : 0;
  int shift[32];
  for (int i = 0; i < 32; ++i) {
    const int low = i % 16, h = i / 16;
    shift[i] = bits == 5 ? 16 * (low % 2) + 8 * h + low / 2 : 16 * (low % 4) + 8 * h + 2 * (low / 4);
  }
  const uint64_t high_mask = (uint64_t(1) << (bits - 4)) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t id = ip[r];
    TORCH_CHECK(id >= 0 && id < n, "id ", id, " outside the weight's ", n, " rows");
    const uint8_t* row = dp + id * data.size(1);
    const float* row_scales = sp + id * (k / block);
    const float* row_offsets = fp != nullptr ? fp + id * (k / block) : nullptr;
    float* o = op + r * k;
    for (int64_t s = 0; s < k / 32; ++s) {
      const uint8_t* piece = row + s * step;
      uint64_t plane = 0;
      if (bits > 4) std::memcpy(&plane, piece + 16, static_cast<size_t>(step - 16));   // little-endian
      for (int i = 0; i < 32; ++i) {
        int32_t u = i < 16 ? (piece[i] & 15) : (piece[i - 16] >> 4);
        if (bits > 4) u |= static_cast<int32_t>((plane >> shift[i]) & high_mask) << 4;
        const int64_t input = s * 32 + i;
        float value = float(u - bias) * row_scales[input / block];
        if (row_offsets != nullptr) value = value + row_offsets[input / block];
        o[input] = value;
      }
    }
  }
  return out;
}

// norm_rope_qkv_ of one float32 QKV row (cos, sin: its [D] rows; the norm weights or nullptr) for the
// AVX2 block kernel's DecodeStack, which calls it through the capsule NORM_ROPE_QKV_ROW_F32 (this
// build's own code: the same floats as the flat decode's norm_rope_qkv_ call). No checks: the caller's.
void norm_rope_qkv_row_f32(float* qkv, int64_t num_heads, int64_t num_kv_heads, int64_t d, const float* cos,
                           const float* sin, const float* q_weight, const float* k_weight, float eps, bool offset) {
  rope_rows<F32>({qkv, 1, num_heads, d, 0, d}, cos, 0, sin, 0, q_weight, eps, offset);
  rope_rows<F32>({qkv + num_heads * d, 1, num_kv_heads, d, 0, d}, cos, 0, sin, 0, k_weight, eps, offset);
}

// How many of torch's threads ran a chunk of at::parallel_for over ``n`` items with grain 1: the
// number of threads when the module was built with OpenMP, 1 when the pragma was compiled away.
int64_t parallel_threads(int64_t n) {
  std::vector<char> seen(at::get_num_threads(), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t count = 0;
  for (char s : seen) count += s;
  return count;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "threads that ran a chunk of at::parallel_for over n items");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (optionally + residual after it)");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual), x + residual)");
  m.def("norm_rope_", &norm_rope_, "per-head RMSNorm (optional) + rotate-half RoPE of q and k, in place");
  m.def("norm_rope_qkv_", &norm_rope_qkv_, "norm_rope_ of the q and k heads of QKV rows, in place");
  m.def("act_and_mul", &act_and_mul, "act(gate) * up of [M, 2d]");
  m.def("packed_rows", &packed_rows, "rows of a packed GGUF weight, dequantized to float32");
  m.def("first_argmax", &first_argmax, "torch.argmax(dim=-1) of float32 rows, in two vectorized passes");
  m.def("causal_softmax", &causal_softmax, "causal / sliding-window softmax of a prefill tile's scores");
  m.attr("NORM_ROPE_QKV_ROW_F32") = py::capsule(reinterpret_cast<void*>(&norm_rope_qkv_row_f32),
                                                "servelm.norm_rope_qkv_row_f32");
}
