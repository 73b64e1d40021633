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
// Compiled at run time by servelm/model/layers/gguf_kernel.py with -mavx512{f,bw,vl,vnni}; the
// Python side checks those CPU flags before it loads this file.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kActBlock = 32;   // activation quantization block
constexpr int kChunk = 64;      // bytes per 512-bit step
constexpr int kRowTile = 4;     // activation rows sharing one pass over a weight row
constexpr int64_t kWeightTile = 32;  // weight rows kept hot in L2 while all activation rows pass

// Float sums of x over each weight block [rows, K / B]: offsets multiply them.
std::vector<float> block_sums(const float* x, int64_t rows, int64_t k, int64_t block) {
  std::vector<float> sums(rows * (k / block));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / block; ++b) {
      float s = 0.f;
      for (int64_t i = 0; i < block; ++i) s += x[r * k + b * block + i];
      sums[r * (k / block) + b] = s;
    }
  return sums;
}

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
template <class Store>
void quantize_blocks(const float* x, int64_t rows, int64_t k, float qmax, std::vector<float>& lane_scales,
                     Store store) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < k / kActBlock; ++b) {
        const float* xb = x + r * k + b * kActBlock;
        float amax = 0.f;
        for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / qmax;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        store(r, b, xb, inv);
        float* lanes = lane_scales.data() + r * (k / 4) + b * (kActBlock / 4);
        for (int i = 0; i < kActBlock / 4; ++i) lanes[i] = d;
      }
    }
  });
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
  std::vector<int8_t> codes;
  std::vector<float> lane_scales;
  int64_t k;

  Int8Activations(const float* x, int64_t rows, int64_t k_) : codes(rows * k_), lane_scales(rows * (k_ / 4)), k(k_) {
    quantize_blocks(x, rows, k, 127.f, lane_scales, [&](int64_t r, int64_t b, const float* xb, float inv) {
      int8_t* qb = codes.data() + r * k + b * kActBlock;
      for (int i = 0; i < kActBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    });
  }

  template <int ROWS>
  void dot(const int8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const __m512i zero = _mm512_setzero_si512();
    const int8_t* xq[ROWS];
    const float* xs[ROWS];   // row pointers held in locals for the whole step loop
    for (int r = 0; r < ROWS; ++r) {
      xq[r] = codes.data() + (r0 + r) * k;
      xs[r] = lane_scales.data() + (r0 + r) * (k / 4);
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
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  std::vector<float> lane_scales;
  int64_t k;

  Int16Activations(const float* x, int64_t rows, int64_t k_)
      : high(rows * k_), low(rows * k_), lane_scales(rows * (k_ / 4)), k(k_) {
    quantize_blocks(x, rows, k, 32512.f, lane_scales, [&](int64_t r, int64_t b, const float* xb, float inv) {
      int8_t* hb = high.data() + r * k + b * kActBlock;
      uint8_t* lb = low.data() + r * k + b * kActBlock;
      for (int i = 0; i < kActBlock; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        const int hi = v >= 0 ? v / 256 : -((-v + 255) / 256);   // floor(v / 256)
        hb[i] = static_cast<int8_t>(hi);
        lb[i] = static_cast<uint8_t>(v - hi * 256);
      }
    });
  }

  template <int ROWS>
  void dot(const int8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const __m512i zero = _mm512_setzero_si512();
    const int8_t* xh[ROWS];
    const uint8_t* xl[ROWS];
    const float* xs[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      xh[r] = high.data() + (r0 + r) * k;
      xl[r] = low.data() + (r0 + r) * k;
      xs[r] = lane_scales.data() + (r0 + r) * (k / 4);
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
                                const c10::optional<torch::Tensor>& offsets, int64_t block, bool bf16_out) {
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
  auto out = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  if (rows == 0 || n == 0) return bf16_out ? out.to(torch::kBFloat16) : out;
  // bf16 activations widened here (exact), not by a torch op per call: a decode step makes 72 calls
  std::vector<float> widened;
  if (x.dtype() == torch::kBFloat16) {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    widened.resize(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) widened[i] = static_cast<float>(xb[i]);
  }
  const float* xp = widened.empty() ? x.data_ptr<float>() : widened.data();
  const Activations acts(xp, rows, k);
  const std::vector<float> sums = has_offsets ? block_sums(xp, rows, k, block) : std::vector<float>();
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t nb = k / block;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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
            if (o != nullptr) value += dot_f32(o + j * nb, sums.data() + (r0 + t) * nb, nb);
            y[(r0 + t) * n + j] = value;
          }
        }
      }
    }
  });
  if (!bf16_out) return out;
  auto rounded = torch::empty({rows, n}, x.options().dtype(torch::kBFloat16));
  c10::BFloat16* rp = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < rows * n; ++i) rp[i] = c10::BFloat16(y[i]);   // round to nearest even, as torch
  return rounded;
}

}  // namespace

torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out) {
  return block_linear_impl<Int8Activations>(x, codes, scales, offsets, block, bf16_out);
}

torch::Tensor block_linear_a16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out) {
  return block_linear_impl<Int16Activations>(x, codes, scales, offsets, block, bf16_out);
}

torch::Tensor block_linear_float(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                 c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out) {
  return block_linear_impl<FloatActivations>(x, codes, scales, offsets, block, bf16_out);
}

// Python: kernel(x, codes, scales, offsets, block, bf16_out=False); x float32 or bfloat16; the result
// float32, or rounded to bfloat16 when bf16_out.
#define BLOCK_LINEAR_ARGS py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"), \
                          py::arg("bf16_out") = false

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear_a16", &block_linear_a16,
        "the same with activations rounded to 16 bits per 32 inputs (two int8 halves, VNNI)", BLOCK_LINEAR_ARGS);
  m.def("block_linear", &block_linear, "x [M, K] float32 @ block-quantized W [N, K] -> [M, N] float32",
        BLOCK_LINEAR_ARGS);
  m.def("block_linear_float", &block_linear_float,
        "the same with float activations (weights dequantized in registers; no activation rounding)",
        BLOCK_LINEAR_ARGS);
}
