// Block-quantized linear for GGUF weights: y[M, N] = x[M, K] @ W.T, W held as int8 codes with one
// float scale (and optionally one float offset) per block of B = 16 or 32 inputs of a row:
//   W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]).
// Every GGUF type servelm repacks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is exactly this
// form with small integer codes, so the repack is lossless.
//
// As llama.cpp does, activations are quantized to int8 per block of 32 (symmetric, scale amax/127)
// and the block dot products run on AVX512-VNNI (vpdpbusd: unsigned x signed bytes). vpdpbusd needs
// one unsigned operand, so it multiplies |w| by x with w's sign moved onto x (llama.cpp's trick),
// which needs no correction term. Offsets multiply the float sum of x over their block.
//
// Compiled at run time by servelm/model/layers/gguf_linear.py with -mavx512{f,bw,vl,vnni}; the
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

// Per activation row: int8 codes [K], per-lane scale [K / 4] (lane j of a 64-byte step covers
// inputs 4j..4j+3, all in one activation block), and float sums per weight block [K / B].
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> lane_scales;
  std::vector<float> block_sums;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t block, bool sums) {
  QuantizedRows q;
  q.codes.resize(rows * k);
  q.lane_scales.resize(rows * (k / 4));
  if (sums) q.block_sums.resize(rows * (k / block));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * k;
      for (int64_t b = 0; b < k / kActBlock; ++b) {
        const float* xb = xr + b * kActBlock;
        float amax = 0.f;
        for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = q.codes.data() + r * k + b * kActBlock;
        for (int i = 0; i < kActBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
        float* lanes = q.lane_scales.data() + r * (k / 4) + b * (kActBlock / 4);
        for (int i = 0; i < kActBlock / 4; ++i) lanes[i] = d;
      }
      if (sums) {
        for (int64_t b = 0; b < k / block; ++b) {
          float s = 0.f;
          for (int64_t i = 0; i < block; ++i) s += xr[b * block + i];
          q.block_sums[r * (k / block) + b] = s;
        }
      }
    }
  });
  return q;
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

// ROWS activation rows against one weight row n.
template <int ROWS>
inline void dot_rows(const int8_t* w, const float* w_scales, const int8_t* const* xq,
                     const float* const* x_lanes, int64_t k, int64_t block, float* out) {
  const __m512i zero = _mm512_setzero_si512();
  // lane j -> weight block of this 64-byte step: j / 8 (B = 32) or j / 4 (B = 16)
  const __m512i index = block == 32
      ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
      : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask8 scale_mask = block == 32 ? 0x3 : 0xF;
  const int64_t blocks_per_step = kChunk / block;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const __m512i wv = _mm512_loadu_si512(w + c * kChunk);
    const __m512i w_abs = _mm512_abs_epi8(wv);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    const __m512 ws = _mm512_permutexvar_ps(
        index, _mm512_castps128_ps512(_mm_maskz_loadu_ps(scale_mask, w_scales + c * blocks_per_step)));
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq[r] + c * kChunk);
      const __m512i signed_x = _mm512_mask_sub_epi8(xv, negative, zero, xv);
      const __m512i d = _mm512_dpbusd_epi32(zero, w_abs, signed_x);
      const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(x_lanes[r] + c * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// 16-bit activations as two int8 halves: q = round(x / d) in [-32512, 32512] with d = amax / 32512
// per 32 inputs, q = 256 * hi + lo, hi in [-127, 127] (signed, |w| x sign trick), lo in [0, 255]
// (unsigned: the first operand of vpdpbusd as is). Per lane: 256 * dot(w, hi) + dot(w, lo) fits in
// int32 (4 * 127 * 128 * 256 + 4 * 255 * 128). The rounding is 2^-16 of the block's largest input.
struct QuantizedRows16 {
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  std::vector<float> lane_scales;
  std::vector<float> block_sums;
};

QuantizedRows16 quantize_rows16(const float* x, int64_t rows, int64_t k, int64_t block, bool sums) {
  QuantizedRows16 q;
  q.high.resize(rows * k);
  q.low.resize(rows * k);
  q.lane_scales.resize(rows * (k / 4));
  if (sums) q.block_sums.resize(rows * (k / block));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    for (int64_t b = 0; b < k / kActBlock; ++b) {
      const float* xb = xr + b * kActBlock;
      float amax = 0.f;
      for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 32512.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int i = 0; i < kActBlock; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        const int hi = v >= 0 ? v / 256 : -((-v + 255) / 256);   // floor(v / 256)
        q.high[r * k + b * kActBlock + i] = static_cast<int8_t>(hi);
        q.low[r * k + b * kActBlock + i] = static_cast<uint8_t>(v - hi * 256);
      }
      float* lanes = q.lane_scales.data() + r * (k / 4) + b * (kActBlock / 4);
      for (int i = 0; i < kActBlock / 4; ++i) lanes[i] = d;
    }
    if (sums) {
      for (int64_t b = 0; b < k / block; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < block; ++i) s += xr[b * block + i];
        q.block_sums[r * (k / block) + b] = s;
      }
    }
  }
  return q;
}

template <int ROWS>
inline void dot_rows16(const int8_t* w, const float* w_scales, const int8_t* const* xh,
                       const uint8_t* const* xl, const float* const* x_lanes, int64_t k, int64_t block,
                       float* out) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i index = block == 32
      ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
      : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask8 scale_mask = block == 32 ? 0x3 : 0xF;
  const int64_t blocks_per_step = kChunk / block;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const __m512i wv = _mm512_loadu_si512(w + c * kChunk);
    const __m512i w_abs = _mm512_abs_epi8(wv);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    const __m512 ws = _mm512_permutexvar_ps(
        index, _mm512_castps128_ps512(_mm_maskz_loadu_ps(scale_mask, w_scales + c * blocks_per_step)));
    for (int r = 0; r < ROWS; ++r) {
      const __m512i hv = _mm512_loadu_si512(xh[r] + c * kChunk);
      const __m512i signed_h = _mm512_mask_sub_epi8(hv, negative, zero, hv);
      const __m512i dh = _mm512_dpbusd_epi32(zero, w_abs, signed_h);
      const __m512i d = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), _mm512_loadu_si512(xl[r] + c * kChunk), wv);
      const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(x_lanes[r] + c * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// Float activations: the weight row is dequantized in registers (code * scale, exactly the float32
// dequantized weight) and multiplied by float x; only the summation order differs from F.linear.
template <int ROWS>
inline void dot_rows_float(const int8_t* w, const float* w_scales, const float* const* x, int64_t k,
                           int64_t block, float* out) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / 32; ++c) {
    const __m512 s0 = _mm512_set1_ps(block == 32 ? w_scales[c] : w_scales[2 * c]);
    const __m512 s1 = _mm512_set1_ps(block == 32 ? w_scales[c] : w_scales[2 * c + 1]);
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32)))), s0);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32 + 16)))), s1);
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + c * 32), acc[r]);
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + c * 32 + 16), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

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

constexpr int kRowTile = 4;     // activation rows sharing one pass over a weight row
constexpr int64_t kWeightTile = 32;  // weight rows kept hot in L2 while all activation rows pass

}  // namespace

torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> offsets, int64_t block) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % kChunk == 0, "K must match and be a multiple of 64");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == n
              && scales.size(1) == k / block, "scales: float32 [N, K / block]");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: float32 like scales");
  }
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, k, block, has_offsets);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t nb = k / block;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const int8_t* xq[kRowTile];
    const float* xl[kRowTile];
    float dots[kRowTile];
    for (int64_t n0 = begin; n0 < end; n0 += kWeightTile) {
      const int64_t n1 = std::min(end, n0 + kWeightTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        for (int t = 0; t < tile; ++t) {
          xq[t] = q.codes.data() + (r0 + t) * k;
          xl[t] = q.lane_scales.data() + (r0 + t) * (k / 4);
        }
        for (int64_t j = n0; j < n1; ++j) {
          const int8_t* wr = w + j * k;
          const float* sr = s + j * nb;
          switch (tile) {
            case 4: dot_rows<4>(wr, sr, xq, xl, k, block, dots); break;
            case 3: dot_rows<3>(wr, sr, xq, xl, k, block, dots); break;
            case 2: dot_rows<2>(wr, sr, xq, xl, k, block, dots); break;
            default: dot_rows<1>(wr, sr, xq, xl, k, block, dots); break;
          }
          for (int t = 0; t < tile; ++t) {
            float value = dots[t];
            if (o != nullptr) value += dot_f32(o + j * nb, q.block_sums.data() + (r0 + t) * nb, nb);
            y[(r0 + t) * n + j] = value;
          }
        }
      }
    }
  });
  return out;
}

torch::Tensor block_linear_float(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                 c10::optional<torch::Tensor> offsets, int64_t block) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % 32 == 0, "K must match and be a multiple of 32");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == n
              && scales.size(1) == k / block, "scales: float32 [N, K / block]");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: float32 like scales");
  }
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  std::vector<float> sums = has_offsets ? block_sums(xp, rows, k, block) : std::vector<float>();
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t nb = k / block;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const float* xr[kRowTile];
    float dots[kRowTile];
    for (int64_t n0 = begin; n0 < end; n0 += kWeightTile) {
      const int64_t n1 = std::min(end, n0 + kWeightTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        for (int t = 0; t < tile; ++t) xr[t] = xp + (r0 + t) * k;
        for (int64_t j = n0; j < n1; ++j) {
          const int8_t* wr = w + j * k;
          const float* sr = s + j * nb;
          switch (tile) {
            case 4: dot_rows_float<4>(wr, sr, xr, k, block, dots); break;
            case 3: dot_rows_float<3>(wr, sr, xr, k, block, dots); break;
            case 2: dot_rows_float<2>(wr, sr, xr, k, block, dots); break;
            default: dot_rows_float<1>(wr, sr, xr, k, block, dots); break;
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
  return out;
}

torch::Tensor block_linear_a16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets, int64_t block) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % kChunk == 0, "K must match and be a multiple of 64");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == n
              && scales.size(1) == k / block, "scales: float32 [N, K / block]");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: float32 like scales");
  }
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  QuantizedRows16 q = quantize_rows16(x.data_ptr<float>(), rows, k, block, has_offsets);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t nb = k / block;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const int8_t* xh[kRowTile];
    const uint8_t* xl[kRowTile];
    const float* xs[kRowTile];
    float dots[kRowTile];
    for (int64_t n0 = begin; n0 < end; n0 += kWeightTile) {
      const int64_t n1 = std::min(end, n0 + kWeightTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        for (int t = 0; t < tile; ++t) {
          xh[t] = q.high.data() + (r0 + t) * k;
          xl[t] = q.low.data() + (r0 + t) * k;
          xs[t] = q.lane_scales.data() + (r0 + t) * (k / 4);
        }
        for (int64_t j = n0; j < n1; ++j) {
          const int8_t* wr = w + j * k;
          const float* sr = s + j * nb;
          switch (tile) {
            case 4: dot_rows16<4>(wr, sr, xh, xl, xs, k, block, dots); break;
            case 3: dot_rows16<3>(wr, sr, xh, xl, xs, k, block, dots); break;
            case 2: dot_rows16<2>(wr, sr, xh, xl, xs, k, block, dots); break;
            default: dot_rows16<1>(wr, sr, xh, xl, xs, k, block, dots); break;
          }
          for (int t = 0; t < tile; ++t) {
            float value = dots[t];
            if (o != nullptr) value += dot_f32(o + j * nb, q.block_sums.data() + (r0 + t) * nb, nb);
            y[(r0 + t) * n + j] = value;
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear_a16", &block_linear_a16,
        "the same with activations rounded to 16 bits per 32 inputs (two int8 halves, VNNI)");
  m.def("block_linear", &block_linear, "x [M, K] float32 @ block-quantized W [N, K] -> [M, N] float32");
  m.def("block_linear_float", &block_linear_float,
        "the same with float activations (weights dequantized in registers; no activation rounding)");
}
