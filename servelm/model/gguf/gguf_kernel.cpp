// Block-quantized linear for GGUF weights: y[M, N] = x[M, K] @ W.T, W held as int8 codes with one
// float scale (and optionally one float offset) per block of B = 16 or 32 inputs of a row:
//   W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]).
// Every GGUF type servelm repacks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is exactly this
// form with small integer codes, so the repack is lossless.
//
// One driver (block_linear_impl) runs three activation formats, each a struct that prepares x once
// per call and computes a tile of rows against one weight row: int8 per 32 inputs as llama.cpp
// (block_linear, --quantization gguf_a8), 16 bits per 32 inputs as two int8 halves (block_linear_a16,
// the default) -- both on AVX512-VNNI (vpdpbusd: unsigned x signed bytes) -- and unrounded float
// (block_linear_float, the exactness reference). Offsets multiply the float sum of x over their block.
//
// Compiled at run time by servelm/model/gguf/gguf_kernel.py with -mavx512{f,bw,vl,vnni}; the
// Python side checks those CPU flags before it loads this file.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "servelm_simd.h"

namespace {

constexpr int kActBlock = 32;   // activation quantization block
constexpr int kChunk = 64;      // bytes per 512-bit step
constexpr int kRowTile = 4;     // activation rows sharing one pass over a weight row
constexpr int64_t kWeightTile = 32;  // weight rows kept hot in L2 while all activation rows pass

constexpr int64_t kMinChunkBytes = 32768;  // the least weight bytes worth a thread of their own
constexpr int64_t kPrefetchBytes = 16384;  // how far ahead of a weight row's step the stream is prefetched

// Per-thread buffers reused from call to call (``slot`` tells apart the buffers of one call): a
// decode step makes 72 small calls, and allocating each call's buffers on the heap was part of
// their fixed cost. Only the calling thread writes them; the workers of its parallel_for read them.
template <class T>
T* scratch(int slot, int64_t count) {
  static thread_local std::vector<T> buffers[3];
  std::vector<T>& buffer = buffers[slot];
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// Float sums of x over each weight block [rows, K / B]: offsets multiply them.
const float* block_sums(const float* x, int64_t rows, int64_t k, int64_t block) {
  float* sums = scratch<float>(2, rows * (k / block));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / block; ++b) {
      float s = 0.f;
      for (int64_t i = 0; i < block; ++i) s += x[r * k + b * block + i];
      sums[r * (k / block) + b] = s;
    }
  return sums;
}

// x [rows, k] as float32: bf16 is widened (exactly: its 16 bits are a float32's high half) into a
// scratch buffer, float32 is used in place.
const float* float_rows(const torch::Tensor& x, int64_t count) {
  if (x.dtype() == torch::kFloat32) return x.data_ptr<float>();
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  float* out = scratch<float>(0, count);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i)));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(wide, 16));
  }
  for (; i < count; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(out + i, &word, sizeof(word));
  }
  return out;
}

// The 16 float32 weight scales of one 64-byte step, one per int32 lane: lane j covers inputs
// 4j..4j+3, in weight block j / 8 (B = 32) or j / 4 (B = 16) of the step. Built once per dot, out
// of the step loop.
struct StepScales {
  __m512i index;
  __mmask8 mask;
  int64_t per_step;

  explicit StepScales(int64_t block)
      : index(block == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                          : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)),
        mask(block == 32 ? 0x3 : 0xF), per_step(kChunk / block) {}

  __m512 load(const float* w_scales, int64_t step) const {
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_maskz_loadu_ps(mask, w_scales + step * per_step)));
  }
};

// Quantizes x per row and kActBlock inputs: d = amax / qmax, ``store(r, b, xb, 1 / d or 0)``
// writes the block's codes, and d fills its kActBlock / 4 lane scales (``lane_scales``: [rows, k / 4]).
// Shared by the int8 and int16 formats (only qmax and the codes' layout differ).
// A few rows (decode) are quantized by the calling thread: a parallel region costs more than they do.
template <class Store>
void quantize_blocks(const float* x, int64_t rows, int64_t k, float qmax, float* lane_scales, Store store) {
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < k / kActBlock; ++b) {
        const float* xb = x + r * k + b * kActBlock;
        const __m512 lo = _mm512_abs_ps(_mm512_loadu_ps(xb)), hi = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
        const float d = amax / qmax;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        store(r, b, xb, inv);
        _mm256_storeu_ps(lane_scales + r * (k / 4) + b * (kActBlock / 4), _mm256_set1_ps(d));
      }
    }
  };
  if (rows <= kRowTile) {
    quantize(0, rows);
  } else {
    at::parallel_for(0, rows, 1, quantize);
  }
}

// round(x * inv) of 16 inputs, to nearest even as std::nearbyint in the default rounding mode
inline __m512i round_scaled(const float* x, float inv) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv)));
}

// One 64-byte step of a weight row, as the vpdpbusd formats use it: vpdpbusd multiplies unsigned
// by signed bytes, so they take |w| and move w's sign onto the activation (llama.cpp's trick).
struct WeightStep {
  __m512i codes;
  __m512i abs_codes;
  __mmask64 negative;   // the lanes whose code is negative
};

// The step loop of the int8 and int16 formats: for each 64-byte step c, ``int_dot(r, c, step)``
// gives row r's 16 int32 lane sums, which are scaled by (weight scale x activation lane scale,
// ``xs[r]``: the row's lane scales) into a float accumulator; out[r] = its sum.
template <int ROWS, class IntDot>
inline void vnni_step_loop(const int8_t* w, const float* w_scales, int64_t block, int64_t k,
                           const float* const* xs, float* out, IntDot int_dot) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const StepScales step_scales(block);
  const int64_t steps = k / kChunk;
  for (int64_t c = 0; c < steps; ++c) {
    // a step streams the weights from memory (a model's decoder weights outgrow the L3 cache): ask
    // for them ahead of the hardware prefetcher, which restarts at every 4 KiB page
    _mm_prefetch(reinterpret_cast<const char*>(w + c * kChunk) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w_scales + c * step_scales.per_step) + kPrefetchBytes / 8,
                 _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + c * kChunk);
    const WeightStep step{wv, _mm512_abs_epi8(wv), _mm512_movepi8_mask(wv)};
    const __m512 ws = step_scales.load(w_scales, c);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i d = int_dot(r, c, step);
      const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xs[r] + c * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// Each activation format below prepares the M rows of x once per call (constructor) and computes
// ROWS of them (from row r0) against one weight row (dot); block_linear_impl does the rest.
// kKMultiple: the K the format's steps need.

// int8 activations, as llama.cpp: q = round(x / d), d = amax / 127 per 32 inputs. vpdpbusd needs
// one unsigned operand, so it multiplies |w| by x with w's sign moved onto x (llama.cpp's trick),
// which needs no correction term.
struct Int8Activations {
  static constexpr int64_t kKMultiple = kChunk;
  const int8_t* codes;
  const float* lane_scales;
  int64_t k;

  Int8Activations(const float* x, int64_t rows, int64_t k_) : k(k_) {
    int8_t* q = scratch<int8_t>(0, rows * k);
    float* lanes = scratch<float>(1, rows * (k / 4));
    quantize_blocks(x, rows, k, 127.f, lanes, [&](int64_t r, int64_t b, const float* xb, float inv) {
      int8_t* qb = q + r * k + b * kActBlock;
      for (int half = 0; half < 2; ++half)   // |q| <= 127: the truncating narrow is exact
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * half),
                         _mm512_cvtepi32_epi8(round_scaled(xb + 16 * half, inv)));
    });
    codes = q;
    lane_scales = lanes;
  }

  template <int ROWS>
  void dot(const int8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const __m512i zero = _mm512_setzero_si512();
    const int8_t* xq[ROWS];
    const float* xs[ROWS];   // row pointers held in locals for the whole step loop
    for (int r = 0; r < ROWS; ++r) {
      xq[r] = codes + (r0 + r) * k;
      xs[r] = lane_scales + (r0 + r) * (k / 4);
    }
    vnni_step_loop<ROWS>(w, w_scales, block, k, xs, out, [&](int r, int64_t c, const WeightStep& step) {
      const __m512i xv = _mm512_loadu_si512(xq[r] + c * kChunk);
      const __m512i signed_x = _mm512_mask_sub_epi8(xv, step.negative, zero, xv);
      return _mm512_dpbusd_epi32(zero, step.abs_codes, signed_x);
    });
  }
};

// 16-bit activations as two int8 halves: q = round(x / d) in [-32512, 32512] with d = amax / 32512
// per 32 inputs, q = 256 * hi + lo, hi in [-127, 127] (signed, |w| x sign trick), lo in [0, 255]
// (unsigned: the first operand of vpdpbusd as is). Per lane: 256 * dot(w, hi) + dot(w, lo) fits in
// int32 (4 * 127 * 128 * 256 + 4 * 255 * 128). The rounding is 2^-16 of the block's largest input.
struct Int16Activations {
  static constexpr int64_t kKMultiple = kChunk;
  const int8_t* high;
  const uint8_t* low;
  const float* lane_scales;
  int64_t k;

  Int16Activations(const float* x, int64_t rows, int64_t k_) : k(k_) {
    int8_t* hi = scratch<int8_t>(0, rows * k);
    uint8_t* lo = scratch<uint8_t>(0, rows * k);
    float* lanes = scratch<float>(1, rows * (k / 4));
    quantize_blocks(x, rows, k, 32512.f, lanes, [&](int64_t r, int64_t b, const float* xb, float inv) {
      int8_t* hb = hi + r * k + b * kActBlock;
      uint8_t* lb = lo + r * k + b * kActBlock;
      for (int half = 0; half < 2; ++half) {
        const __m512i v = round_scaled(xb + 16 * half, inv);
        // hi = floor(v / 256) (the arithmetic shift), lo = v - 256 * hi = v & 255; both fit a byte
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hb + 16 * half), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 8)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lb + 16 * half),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(255))));
      }
    });
    high = hi;
    low = lo;
    lane_scales = lanes;
  }

  template <int ROWS>
  void dot(const int8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const __m512i zero = _mm512_setzero_si512();
    const int8_t* xh[ROWS];
    const uint8_t* xl[ROWS];
    const float* xs[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      xh[r] = high + (r0 + r) * k;
      xl[r] = low + (r0 + r) * k;
      xs[r] = lane_scales + (r0 + r) * (k / 4);
    }
    vnni_step_loop<ROWS>(w, w_scales, block, k, xs, out, [&](int r, int64_t c, const WeightStep& step) {
      const __m512i hv = _mm512_loadu_si512(xh[r] + c * kChunk);
      const __m512i signed_h = _mm512_mask_sub_epi8(hv, step.negative, zero, hv);
      const __m512i dh = _mm512_dpbusd_epi32(zero, step.abs_codes, signed_h);
      return _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), _mm512_loadu_si512(xl[r] + c * kChunk), step.codes);
    });
  }
};

// Float activations, unrounded: the weight row is dequantized in registers (code * scale, exactly
// the float32 dequantized weight) and multiplied by x; only the summation order differs from F.linear.
struct FloatActivations {
  static constexpr int64_t kKMultiple = 32;
  const float* x;
  int64_t k;

  FloatActivations(const float* x_, int64_t /*rows*/, int64_t k_) : x(x_), k(k_) {}

  template <int ROWS>
  void dot(const int8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const float* xr[ROWS];
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      xr[r] = x + (r0 + r) * k;
      acc[r] = _mm512_setzero_ps();
    }
    const int64_t steps = k / 32;
    for (int64_t c = 0; c < steps; ++c) {
      const __m512 s0 = _mm512_set1_ps(block == 32 ? w_scales[c] : w_scales[2 * c]);
      const __m512 s1 = _mm512_set1_ps(block == 32 ? w_scales[c] : w_scales[2 * c + 1]);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32)))), s0);
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32 + 16)))), s1);
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr[r] + c * 32), acc[r]);
        acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr[r] + c * 32 + 16), acc[r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
  }
};

// y = x @ W.T for one activation format: argument checks, tiling (kWeightTile weight rows x
// kRowTile activation rows per pass, weight rows split over threads) and the offsets term.
template <class Activations>
torch::Tensor block_linear_impl(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                const c10::optional<torch::Tensor>& offsets, int64_t block, bool bf16_out,
                                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % Activations::kKMultiple == 0,
              "K must match and be a multiple of ", Activations::kKMultiple);
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == n
              && scales.size(1) == k / block, "scales: float32 [N, K / block]");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: float32 like scales");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK((bias->dtype() == torch::kFloat32 || bias->dtype() == torch::kBFloat16) && bias->dim() == 1
                && bias->is_contiguous() && bias->size(0) == n, "bias: contiguous float32 or bfloat16 [N]");
  }
  // bf16 output is rounded by the threads as they write it (no float32 result, no serial pass over it)
  auto out = torch::empty({rows, n}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  if (rows == 0 || n == 0) return out;
  // bf16 activations widened here (exact), not by a torch op per call: a decode step makes 72 calls
  const float* xp = float_rows(x, rows * k);
  const Activations acts(xp, rows, k);
  const float* sums = has_offsets ? block_sums(xp, rows, k, block) : nullptr;
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  const float* bias32 = has_bias && bias->dtype() == torch::kFloat32 ? bias->data_ptr<float>() : nullptr;
  const c10::BFloat16* bias16 = has_bias && bias->dtype() == torch::kBFloat16 ? bias->data_ptr<c10::BFloat16>()
                                                                               : nullptr;
  float* y = bf16_out ? nullptr : out.data_ptr<float>();
  c10::BFloat16* y16 = bf16_out ? out.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t nb = k / block;
  // a thread takes at least kMinChunkBytes of weights: below that the fork and join cost more than
  // the second thread saves (Gemma's k/v-sized calls)
  const int64_t grain = std::max<int64_t>(16, kMinChunkBytes / k);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float dots[kRowTile];
    for (int64_t n0 = begin; n0 < end; n0 += kWeightTile) {
      const int64_t n1 = std::min(end, n0 + kWeightTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        for (int64_t j = n0; j < n1; ++j) {
          const int8_t* wr = w + j * k;
          const float* sr = s + j * nb;
          switch (tile) {
            case 4: acts.template dot<4>(wr, sr, block, r0, dots); break;
            case 3: acts.template dot<3>(wr, sr, block, r0, dots); break;
            case 2: acts.template dot<2>(wr, sr, block, r0, dots); break;
            default: acts.template dot<1>(wr, sr, block, r0, dots); break;
          }
          for (int t = 0; t < tile; ++t) {
            float value = dots[t];
            if (o != nullptr) value += servelm_simd::dot_f32(o + j * nb, sums + (r0 + t) * nb, nb);
            // the bias added in float32 before the rounding: torch's ``out + bias`` then ``.to(bf16)``
            if (bias32 != nullptr) value += bias32[j];
            if (bias16 != nullptr) value += static_cast<float>(bias16[j]);
            if (y16 != nullptr) {
              y16[(r0 + t) * n + j] = c10::BFloat16(value);   // round to nearest even, as torch
            } else {
              y[(r0 + t) * n + j] = value;
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out,
                           c10::optional<torch::Tensor> bias) {
  return block_linear_impl<Int8Activations>(x, codes, scales, offsets, block, bf16_out, bias);
}

torch::Tensor block_linear_a16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out,
                               c10::optional<torch::Tensor> bias) {
  return block_linear_impl<Int16Activations>(x, codes, scales, offsets, block, bf16_out, bias);
}

torch::Tensor block_linear_float(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                 c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out,
                                 c10::optional<torch::Tensor> bias) {
  return block_linear_impl<FloatActivations>(x, codes, scales, offsets, block, bf16_out, bias);
}

// Python: kernel(x, codes, scales, offsets, block, bf16_out=False, bias=None); x float32 or bfloat16; the
// result float32, or rounded to bfloat16 when bf16_out; a bias [N] (float32 or bfloat16) is added in
// float32 before that rounding (a biased decode layer's one call instead of three).
#define BLOCK_LINEAR_ARGS py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"), \
                          py::arg("bf16_out") = false, py::arg("bias") = py::none()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear_a16", &block_linear_a16,
        "the same with activations rounded to 16 bits per 32 inputs (two int8 halves, VNNI)", BLOCK_LINEAR_ARGS);
  m.def("block_linear", &block_linear, "x [M, K] float32 @ block-quantized W [N, K] -> [M, N] float32",
        BLOCK_LINEAR_ARGS);
  m.def("block_linear_float", &block_linear_float,
        "the same with float activations (weights dequantized in registers; no activation rounding)",
        BLOCK_LINEAR_ARGS);
}
