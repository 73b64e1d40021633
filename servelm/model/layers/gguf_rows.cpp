// Block-quantized linear for a few to a few dozen bf16 activation rows (batched decode, speculative
// verify, the LM head at M > 1): y[M, N] = x[M, K] @ W.T with W held as GGUF blocks
//   W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]),   B = 16 or 32, |codes| <= 128.
//
// Each weight row's int8 codes are read ONCE per call and widened in registers to bf16 (every
// |code| <= 128 is exact in bf16), into a small per-thread buffer of kTileRows rows; every activation
// row then meets them with vdpbf16ps (bf16 pairs -> float32), kTileRows weight rows x kRegRows
// activation rows of accumulators at a time. The scales are applied in float32, once per 64 inputs:
// so the weight is code x scale exactly (the dense bf16 copy rounds code*scale to 8 bits), and the
// cost per extra row is two vdpbf16ps and one FMA per 64 inputs, not a pass of quantization work.
//
// Lane layout (why x is permuted once per call): the 64 codes of a step widen to four float vectors
// f0..f3 (16 codes each) and pack to two bf16 vectors v0 = [f0 | f2], v1 = [f1 | f3]. vdpbf16ps lane
// l sums elements 2l and 2l+1, so lanes 0-7 of v0 and v1 hold codes 0-31 (one block of 32) and
// lanes 8-15 codes 32-63 (the next block): one FMA with the scale vector [s0 x 8, s1 x 8] scales
// both. With B = 16, v0's halves are blocks 0 and 2, v1's blocks 1 and 3: one FMA per vector.
// x is rearranged into the same element order once per call (``permute_rows``).
//
// Offsets (Q4_1, Q5_1, Q4_K, Q5_K) add offset x (float sum of x over the block), in float32.
// Compiled at run time by servelm/model/layers/gguf_rows.py with -mavx512{f,bw,vl,bf16}; the Python
// side checks the CPU flags (avx512_bf16 included) before it loads this file.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kStep = 64;      // inputs per step: two bf16 vectors of 32
constexpr int kTileRows = 4;       // weight rows widened together into the per-thread buffer
constexpr int kRegRows = 4;        // activation rows per register tile (kTileRows x kRegRows accumulators)

// x [M, K] bf16 -> [M, K / 64, 64] in the element order of the widened weights: per step,
// x[0:16], x[32:48] (v0's order), x[16:32], x[48:64] (v1's).
// Held as vectors so that the buffer is 64-byte aligned.
std::vector<__m512bh> permute_rows(const uint16_t* x, int64_t rows, int64_t k) {
  std::vector<__m512bh> out(rows * k / 32);
  static constexpr int kFrom[4] = {0, 32, 16, 48};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k / kStep; ++c) {
      const uint16_t* src = x + r * k + c * kStep;
      uint16_t* dst = reinterpret_cast<uint16_t*>(out.data()) + r * k + c * kStep;
      for (int q = 0; q < 4; ++q) std::memcpy(dst + 16 * q, src + kFrom[q], 16 * sizeof(uint16_t));
    }
  return out;
}

// Float sums of x over each weight block [rows, K / B]: offsets multiply them.
std::vector<float> block_sums(const uint16_t* x, int64_t rows, int64_t k, int64_t block) {
  std::vector<float> sums(rows * (k / block));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / block; ++b) {
      float s = 0.f;
      for (int64_t i = 0; i < block; ++i) {
        const uint32_t bits = static_cast<uint32_t>(x[r * k + b * block + i]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof(v));
        s += v;
      }
      sums[r * (k / block) + b] = s;
    }
  return sums;
}

inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One weight row's codes -> bf16 in the lane layout above: [K / 64][2] vectors of 32.
inline void widen_row(const int8_t* w, int64_t steps, __m512bh* out) {
  for (int64_t c = 0; c < steps; ++c) {
    const int8_t* p = w + c * kStep;
    out[2 * c] = _mm512_cvtne2ps_pbh(widen16(p + 32), widen16(p));
    out[2 * c + 1] = _mm512_cvtne2ps_pbh(widen16(p + 48), widen16(p + 16));
  }
}

// Scale vectors of step c. B = 32: one, [s(2c) x 8, s(2c+1) x 8]. B = 16: v0's [s(4c) x 8, s(4c+2) x 8]
// and v1's [s(4c+1) x 8, s(4c+3) x 8].
struct StepScales {
  __m512i first, second;
  explicit StepScales(int64_t block)
      : first(block == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                          : _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)),
        second(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1)) {}
};

// acc[i][r] += weight rows i (widened in wbuf) . x rows r0 + r over all steps, scaled per block.
template <int BLOCK, int ROWS>
inline void tile_dot(const __m512bh* const* wrows, const float* const* srows, const __m512bh* const* xrows,
                     int64_t steps, const StepScales& idx, float out[kTileRows][kRegRows]) {
  __m512 acc[kTileRows][ROWS];
  for (int i = 0; i < kTileRows; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t c = 0; c < steps; ++c) {
    __m512 s0[kTileRows], s1[kTileRows];
    for (int i = 0; i < kTileRows; ++i) {
      if (BLOCK == 32) {
        const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(srows[i] + 2 * c)));
        s0[i] = _mm512_permutexvar_ps(idx.first, _mm512_castps128_ps512(pair));
      } else {
        const __m512 four = _mm512_castps128_ps512(_mm_loadu_ps(srows[i] + 4 * c));
        s0[i] = _mm512_permutexvar_ps(idx.first, four);
        s1[i] = _mm512_permutexvar_ps(idx.second, four);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh x0 = xrows[r][2 * c], x1 = xrows[r][2 * c + 1];
      for (int i = 0; i < kTileRows; ++i) {
        if (BLOCK == 32) {
          const __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(zero, wrows[i][2 * c], x0), wrows[i][2 * c + 1], x1);
          acc[i][r] = _mm512_fmadd_ps(t, s0[i], acc[i][r]);
        } else {
          acc[i][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wrows[i][2 * c], x0), s0[i], acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wrows[i][2 * c + 1], x1), s1[i], acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < kTileRows; ++i)
    for (int r = 0; r < ROWS; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

// tile_dot for ``rows`` (1..kRegRows) activation rows.
template <int BLOCK, int ROWS = kRegRows>
void tile_dispatch(int rows, const __m512bh* const* wrows, const float* const* srows, const __m512bh* const* xrows,
                   int64_t steps, const StepScales& idx, float out[kTileRows][kRegRows]) {
  if (rows == ROWS || ROWS == 1) {
    tile_dot<BLOCK, ROWS>(wrows, srows, xrows, steps, idx, out);
  } else if constexpr (ROWS > 1) {
    tile_dispatch<BLOCK, ROWS - 1>(rows, wrows, srows, xrows, steps, idx, out);
  }
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

}  // namespace

// Python: rows_linear(x, codes, scales, offsets, block, bf16_out=False): x [M, K] bfloat16, codes int8
// [N, K], scales (offsets) float32 [N, K / block]; K a multiple of 64. Returns [M, N] float32, or
// rounded to bfloat16 (nearest even, as torch) when bf16_out.
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % kStep == 0, "K must match and be a multiple of ", kStep);
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2
              && scales.size(0) == n && scales.size(1) == k / block, "scales: float32 [N, K / block]");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: float32 like scales");
  }
  auto out = torch::empty({rows, n}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  if (rows == 0 || n == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const std::vector<__m512bh> xperm = permute_rows(xp, rows, k);
  const std::vector<float> sums = has_offsets ? block_sums(xp, rows, k, block) : std::vector<float>();
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* yf = bf16_out ? nullptr : out.data_ptr<float>();
  at::BFloat16* yb = bf16_out ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t nb = k / block, steps = k / kStep, tiles = (n + kTileRows - 1) / kTileRows;
  const StepScales idx(block);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> wbuf(kTileRows * 2 * steps);
    const __m512bh* wrows[kTileRows];
    const float* srows[kTileRows];
    const __m512bh* xrows[kRegRows];
    float dots[kTileRows][kRegRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int valid = static_cast<int>(std::min<int64_t>(kTileRows, n - n0));
      for (int i = 0; i < kTileRows; ++i) {
        const int64_t j = n0 + std::min(i, valid - 1);   // a short last tile repeats its last row
        if (i < valid) widen_row(w + j * k, steps, wbuf.data() + i * 2 * steps);
        wrows[i] = wbuf.data() + std::min(i, valid - 1) * 2 * steps;
        srows[i] = s + j * nb;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRegRows) {
        const int tile = static_cast<int>(std::min<int64_t>(kRegRows, rows - r0));
        for (int r = 0; r < tile; ++r)
          xrows[r] = xperm.data() + (r0 + r) * (k / 32);
        if (block == 32) tile_dispatch<32>(tile, wrows, srows, xrows, steps, idx, dots);
        else tile_dispatch<16>(tile, wrows, srows, xrows, steps, idx, dots);
        for (int i = 0; i < valid; ++i)
          for (int r = 0; r < tile; ++r) {
            float value = dots[i][r];
            if (o != nullptr) value += dot_f32(o + (n0 + i) * nb, sums.data() + (r0 + r) * nb, nb);
            const int64_t at = (r0 + r) * n + n0 + i;
            if (yf != nullptr) yf[at] = value;
            else yb[at] = at::BFloat16(value);   // round to nearest even, as torch
          }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear,
        "x [M, K] bfloat16 @ block-quantized W [N, K] -> [M, N] float32 (bfloat16 when bf16_out): "
        "weights widened to bf16 once per call, vdpbf16ps against every row, scales in float32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false);
}
