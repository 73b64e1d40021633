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
// Compiled at run time by servelm/model/gguf/gguf_rows.py with -mavx512{f,bw,vl,bf16}; the Python
// side checks the CPU flags (avx512_bf16 included) before it loads this file.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "servelm_activation.h"
#include "servelm_parallel.h"
#include "servelm_amx.h"
#include "servelm_simd.h"

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
// Whether a GGUF weight has per-block offsets (Q4_K/Q5_K mins); checks they are laid out like its scales.
bool checked_offsets(const c10::optional<torch::Tensor>& offsets, const torch::Tensor& scales) {
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets) {
    TORCH_CHECK(offsets->dtype() == scales.dtype() && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: like scales (dtype and shape)");
  }
  return has_offsets;
}

std::vector<float> block_sums(const uint16_t* x, int64_t rows, int64_t k, int64_t block) {
  std::vector<float> sums(rows * (k / block));
  const auto load16 = [](const uint16_t* p) {   // 16 bf16 -> float32 (exact)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / block; ++b) {
      const uint16_t* xb = x + r * k + b * block;
      __m512 v = load16(xb);
      if (block == 32) v = _mm512_add_ps(v, load16(xb + 16));
      sums[r * (k / block) + b] = _mm512_reduce_add_ps(v);
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
  const bool has_offsets = checked_offsets(offsets, scales);
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
            if (o != nullptr) value += servelm_simd::dot_f32(o + (n0 + i) * nb, sums.data() + (r0 + r) * nb, nb);
            const int64_t at = (r0 + r) * n + n0 + i;
            if (yf != nullptr) yf[at] = value;
            else yb[at] = at::BFloat16(value);   // round to nearest even, as torch
          }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// rows_gemm: the same product as a GEMM micro-kernel, on a copy of the codes packed at load in
// VNNI order (``pack`` below, made by gguf_rows.py from the BlockWeight):
//   codes  [T, K / 2, C, 16, 2]  (T tiles of C x 16 outputs, N rounded up to whole tiles with zero
//          codes): per tile and input pair p, C vectors of 16 outputs' pairs, 32 bytes each (a byte
//          a code; the packed forms below: 32 or 40 bytes a pair step), so that the whole copy is
//          read as one sequential stream
//   scales [T, K / B, C, 16] float32, or fp16 where every scale and offset is an fp16 value (Q8_0's,
//          Q5_0's, Q4_0's: half the scales' bytes, widened exactly), or (the K-quants' in the packed
//          route's copy) int8 sub-scales [T, K / B, C, 16] then float32 multipliers [T, K / 256, C, 16]
//          in one int8 tensor [T, K / B + 4 K / 256, C, 16] (``block_scales``); offsets alike
// Lanes are outputs: vdpbf16ps(t, w, x) adds w[n, 2p] x[2p] + w[n, 2p + 1] x[2p + 1] to lane n, with
// the activation pair broadcast from memory (no permutation of x, no horizontal sums). An
// accumulator block of R rows x C vectors of 16 outputs sums one GGUF block's B / 2 pairs into
// temporaries, which one FMA per block scales into the float32 result: the weight is exactly
// code x scale, as in rows_linear. The codes are widened to bf16 in registers right before use; the
// copy holds them a byte each, in one of two forms,
//   int8 codes (any |code| <= 128): sign-extended to int32, converted to float, packed to bf16
//     (five instructions per 32 codes);
//   biased codes (every code in [-64, 63], as Q4-Q6 types have; uint8 u = code + 64): the bf16 bits
//     0x4300 | u are exactly 128 + u = code + 192 (exponent 2^7, u the 7 mantissa bits), so a
//     zero-extension and an OR widen 32 codes; each block's sum then starts at -192 x (the float sum
//     of x over the block) instead of zero, which leaves code . x (rounded in float32 around terms
//     up to 255 |x| instead of 64 |x|). 5-20% faster from 8 rows up on AMD Zen 4 (2 threads).
// or at their bit width (the ``packed`` route's copy, ``pack(..., bits=True)``): per pair step 32 bytes
// of nibbles (vector 0's u in the low nibble of byte j, vector 1's in the high one; one zero-extension
// of 32 bytes, an AND and a shift give both vectors' u) and, for five bits, two 32-bit masks of the
// fifth bit (a masked add of 16): u = code (Q4_1, Q4_K: [0, 15]) or code + 16 (Q5_0, Q4_0: [-16, 15]);
// for six bits, two more masks of the sixth bit (a masked add of 32): u = code + 32 (Q6_K: [-32, 31]);
// widened by the same OR, each block's sum starting at -(128 + the offset) x the block sum. 0.5,
// 0.625 or 0.75 bytes a weight: bound by memory at one row, 1.5-1.7x the byte copy's speed there on Zen 4;
// the byte copy's fewer instructions win from ~8 rows, and the route table picks per row class.
// Each row's arithmetic is the same whatever R: a row's result does not depend on the other rows.
namespace {

enum class Codes { kInt8, kBiased, kNibbles, kFiveBits, kSixBits };

// The value a code's bf16 vector holds is code + bias(kCodes): 0x4300 | u = 128 + u, u = code + 64
// (biased bytes), code (nibbles: codes in [0, 15]), code + 16 (five bits: codes in [-16, 15]) or code + 32
// (six bits: codes in [-32, 31])
constexpr float code_bias(Codes codes) {
  return codes == Codes::kBiased ? 192.f : codes == Codes::kNibbles ? 128.f : codes == Codes::kFiveBits ? 144.f
         : codes == Codes::kSixBits ? 160.f : 0.f;
}

constexpr bool is_bit_form(Codes codes) {
  return codes == Codes::kNibbles || codes == Codes::kFiveBits || codes == Codes::kSixBits;
}

// Bytes of a pair step (C = 2 vectors of 16 outputs x 2 inputs): a byte a code, or the packed forms'
// 32 bytes of nibbles (vector 0's u & 15 in the low nibble of byte j, vector 1's in the high one)
// and, with five bits, two 32-bit masks of bit 4 of u (vector 0's, then vector 1's); with six, two
// more of bit 5
constexpr int64_t step_bytes(Codes codes) {
  return codes == Codes::kNibbles ? 32 : codes == Codes::kFiveBits ? 40 : codes == Codes::kSixBits ? 48 : 64;
}

template <Codes kCodes>
inline __m512bh load_pair_vector(const void* codes, int64_t index) {
  if constexpr (kCodes == Codes::kBiased) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(codes) + index * 32));
    return reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_cvtepu8_epi16(u), _mm512_set1_epi16(0x4300)));
  } else {
    const int8_t* p = static_cast<const int8_t*>(codes) + index * 32;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

struct GemmArgs {
  const uint16_t* x;      // [M, K] bf16
  const void* codes;      // packed, see above
  const void* scales;     // packed: float32, fp16 or sub-scaled (scale_form)
  const void* offsets;    // packed like scales, or nullptr
  const float* sums;      // [M, K / B] block sums of x (with offsets or biased codes)
  int64_t k, n, block;
  float* yf;              // [M, N] float32 out, or
  uint16_t* yb;           // bf16 out
  bool stream;            // float32 out written with non-temporal stores (64-byte aligned rows)
  int scale_form;         // kF32Scales, kF16Scales or kSubScales: how scales and offsets are held
  bool once;              // every row in one group: the codes are read once (non-temporal prefetches)
  const float* bias32;    // [N] added to the results in float32 before any rounding, or nullptr;
  const uint16_t* bias16; // or a bf16 bias (widened exactly), or nullptr
  int act;                // rows_act: the activation (0 SiLU, 1 GELU tanh) of a gated MLP's gate_up, or -1
  int64_t half_tiles;     // rows_act: the tiles of the gate half (the up half's follow)
};

// A float32 vector rounded to bf16 (nearest even) and widened back: the value a bf16 output holds.
inline __m512 round_bf16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
}

// rows_act's epilogue of one accumulator block: a gate tile's results (rounded to bf16, as gate_up's
// output holds them) wait in ``gate`` (R x C vectors); the matching up tile's meet them as fused_ops'
// act_and_mul does: round(round(act(gate)) x round(up)), stored as bf16 in the [M, N / 2] output.
template <int R, int C>
void act_epilogue(const GemmArgs& a, const __m512 (&acc)[R][C], int64_t r0, int64_t tile, float* gate) {
  const bool up = tile >= a.half_tiles;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float* held = gate + (r * C + c) * 16;
      const __m512 v = round_bf16(acc[r][c]);
      if (!up) {
        _mm512_storeu_ps(held, v);
        continue;
      }
      const __m512 g = _mm512_loadu_ps(held);
      const __m512 act = round_bf16(a.act == 0 ? servelm_activation::activate16<0>(g)
                                                : servelm_activation::activate16<1>(g));
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(act, v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.yb + (r0 + r) * (a.n / 2) + ((tile - a.half_tiles) * C + c) * 16),
                          reinterpret_cast<const __m256i&>(out));
    }
}

constexpr int kF32Scales = 0, kF16Scales = 1, kSubScales = 2;

// The 16 scales (or offsets) of block b of vector c of ``tile`` (C vectors a tile, nb blocks a row), as
// float32: held as float32, as fp16 (every one an fp16 value: widened exactly), or (kSubScales, the
// K-quants') as int8 sub-scales times a float32 multiplier per 256 inputs, a tile's [nb, C, 16] bytes
// of sub-scales then its [K / 256, C, 16] floats of multipliers: the same float32 product
// (sub x multiplier, exact) that the BlockWeight's scales are.
inline __m512 block_scales(const GemmArgs& a, const void* base, int64_t tile, int64_t b, int c, int C, int64_t nb) {
  if (a.scale_form == kSubScales) {
    const int64_t supers = a.k / 256;
    const int8_t* held = static_cast<const int8_t*>(base) + tile * (nb + 4 * supers) * C * 16;
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(held + (b * C + c) * 16))));
    const float* multipliers = reinterpret_cast<const float*>(held + nb * C * 16);
    return _mm512_mul_ps(sub, _mm512_loadu_ps(multipliers + ((b * a.block / 256) * C + c) * 16));
  }
  const int64_t at = ((tile * nb + b) * C + c) * 16;
  if (a.scale_form == kF16Scales)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}

constexpr int64_t kPrefetchPairs = 160;   // how far ahead the weight streams are prefetched

// The codes ahead: where the call reads them once (a few rows: one group) and ``nta_prefetch`` is on, as
// non-temporal lines, so that the stream (the whole weight, each decode step) does not evict what the
// step's other work keeps in the caches (its activations, the next calls' code and data): 5-16% faster
// one-row steps in 8 of 10 alternated runs (AMD Zen 4 VM, Gemma 3 270M and Qwen2.5-Coder 0.5B); on an
// Intel Xeon with AMX (session 47) the same calls took 1.7-2.8x as long as with T0 prefetches, so the
// route table measures both (model/routes.py ``PREFETCH_CELL``) and sets the faster (``set_nta_prefetch``).
// Where several row groups pass over a panel of tiles, kept in the caches for the next group.
std::atomic<bool> nta_prefetch{true};
inline void prefetch_codes(const GemmArgs& a, const char* line) {
  if (a.once) _mm_prefetch(line, _MM_HINT_NTA);
  else _mm_prefetch(line, _MM_HINT_T0);
}

// The C vectors of input pair p of ``tile`` (16 outputs' two codes each), widened to bf16 as the top of
// this part says (each holds code + code_bias(kCodes)); the stream ahead prefetched.
template <int C, Codes kCodes>
inline void load_pair(const GemmArgs& a, int64_t tile, int64_t p, __m512bh (&w)[C]) {
  const int64_t pairs = a.k / 2;
  if constexpr (is_bit_form(kCodes)) {
    const uint8_t* step = static_cast<const uint8_t*>(a.codes) + (tile * pairs + p) * step_bytes(kCodes);
    prefetch_codes(a, reinterpret_cast<const char*>(step) + kPrefetchPairs * step_bytes(kCodes));
    const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step)));
    __m512i u0 = _mm512_and_si512(both, _mm512_set1_epi16(0x000F)), u1 = _mm512_srli_epi16(both, 4);
    if constexpr (kCodes != Codes::kNibbles) {
      uint32_t m[4];
      std::memcpy(m, step + 32, (step_bytes(kCodes) - 32));
      u0 = _mm512_mask_add_epi16(u0, m[0], u0, _mm512_set1_epi16(16));
      u1 = _mm512_mask_add_epi16(u1, m[1], u1, _mm512_set1_epi16(16));
      if constexpr (kCodes == Codes::kSixBits) {
        u0 = _mm512_mask_add_epi16(u0, m[2], u0, _mm512_set1_epi16(32));
        u1 = _mm512_mask_add_epi16(u1, m[3], u1, _mm512_set1_epi16(32));
      }
    }
    w[0] = reinterpret_cast<__m512bh>(_mm512_or_si512(u0, _mm512_set1_epi16(0x4300)));
    w[1] = reinterpret_cast<__m512bh>(_mm512_or_si512(u1, _mm512_set1_epi16(0x4300)));
  } else {
    for (int c = 0; c < C; ++c) {
      const int64_t index = (tile * pairs + p) * C + c;
      prefetch_codes(a, static_cast<const char*>(a.codes) + (index + kPrefetchPairs) * 32);
      w[c] = load_pair_vector<kCodes>(a.codes, index);
    }
  }
}

// Rows r0 .. r0 + R - 1 of ``tile``'s results (acc: float32, offsets added) to the output: the bias added in
// float32, then stored as float32 (non-temporal where ``stream``) or rounded to bf16.
template <int R, int C>
inline void store_rows(const GemmArgs& a, __m512 (&acc)[R][C], int64_t r0, int64_t tile) {
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (tile * C + c) * 16;
    if (n0 >= a.n) break;
    const __mmask16 mask = a.n - n0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (a.n - n0)) - 1);
    if (a.bias32 != nullptr || a.bias16 != nullptr) {   // torch's ``out + bias`` in float32, then any rounding
      const __m512 bias = servelm_simd::load_bias16(a.bias32, a.bias16, n0, mask);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_add_ps(acc[r][c], bias);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * a.n + n0;
      if (a.stream && mask == 0xFFFF) _mm512_stream_ps(a.yf + at, acc[r][c]);
      else if (a.yf != nullptr) _mm512_mask_storeu_ps(a.yf + at, mask, acc[r][c]);
      else _mm256_mask_storeu_epi16(a.yb + at, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][c])));
    }
  }
}

// Rows r0 .. r0 + R - 1 against the outputs of ``tile`` (C x 16 of them).
template <int R, int C, Codes kCodes, bool kOffsets>
void micro_tile(const GemmArgs& a, int64_t r0, int64_t tile, float* gate) {
  static_assert(C == 2 || !is_bit_form(kCodes), "the packed forms hold 2 vectors a step");
  // The offsets' terms (offset x the block's sum of x) are summed on their own, block by block from
  // zero, and added to the scaled block sums at the end: the same floats wherever they are summed, so a
  // row's result does not depend on R. Up to 6 rows in each block's epilogue; from 7 after the blocks,
  // where t and acc leave them no registers (with 8 rows in the epilogue, acc was reloaded and stored
  // twice a block). Qwen2.5 0.5B's Q4_K down projection against the old kernel (offsets straight into
  // acc in each epilogue), alternated in one process, AMD Zen 4, 2 threads: 1-6 rows 0.96-1.01x the
  // time, 7 rows 1.04x (1.09x with them in the epilogue), 8 rows 0.89-0.96x, 32 rows 0.86-0.88x.
  constexpr bool kOffsetsInLoop = R <= 6;
  const int64_t nb = a.k / a.block, per_block = a.block / 2;
  __m512 acc[R][C], off[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = off[r][c] = _mm512_setzero_ps();
  const auto add_offsets = [&](int64_t b, int c) {   // block b's offset terms of vector c
    const __m512 o = block_scales(a, a.offsets, tile, b, c, C, nb);
    for (int r = 0; r < R; ++r) off[r][c] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.sums[(r0 + r) * nb + b]), off[r][c]);
  };
  const uint16_t* x = a.x + r0 * a.k;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 t[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512 start = kCodes != Codes::kInt8 ? _mm512_set1_ps(-code_bias(kCodes) * a.sums[(r0 + r) * nb + b])
                                                  : _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) t[r][c] = start;
    }
    for (int64_t p = b * per_block; p < (b + 1) * per_block; ++p) {
      __m512bh w[C];
      load_pair<C, kCodes>(a, tile, p, w);
      for (int r = 0; r < R; ++r) {
        const __m512bh xr = broadcast_pair(x + r * a.k + 2 * p);
        for (int c = 0; c < C; ++c) t[r][c] = _mm512_dpbf16_ps(t[r][c], w[c], xr);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 s = block_scales(a, a.scales, tile, b, c, C, nb);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(t[r][c], s, acc[r][c]);
      if constexpr (kOffsets && kOffsetsInLoop) add_offsets(b, c);
    }
  }
  if constexpr (kOffsets) {
    if constexpr (!kOffsetsInLoop) {
      for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < C; ++c) add_offsets(b, c);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_add_ps(acc[r][c], off[r][c]);
  }
  if (a.act >= 0) {
    act_epilogue<R, C>(a, acc, r0, tile, gate);
    return;
  }
  store_rows<R, C>(a, acc, r0, tile);
}

constexpr int64_t kStreamBytes = 4 << 20;   // float32 results at least this large: non-temporal stores
constexpr int kGemmCols = 2;     // 16-output vectors per accumulator block (tiles of 32 outputs)
// Codes every row group passes over before the next group takes them (from L2): each row's results
// are then written in runs of a panel's width, not of one tile's
constexpr int64_t kPanelBytes = 320 << 10;
constexpr int kGemmRows = 8;     // most rows per accumulator block: 16 temporaries + 16 sums
constexpr int64_t kUnitsPerThread = 2;   // work units a thread takes at least (of at most a panel)

template <int C, Codes kCodes, bool kOffsets, int R = kGemmRows>
void dispatch_rows(int rows, const GemmArgs& a, int64_t r0, int64_t tile, float* gate) {
  if (rows == R || R == 1) {
    micro_tile<R, C, kCodes, kOffsets>(a, r0, tile, gate);
  } else if constexpr (R > 1) {
    dispatch_rows<C, kCodes, kOffsets, R - 1>(rows, a, r0, tile, gate);
  }
}

template <Codes kCodes, bool kOffsets>
void run_gemm(const GemmArgs& a, int64_t rows) {
  // rows in groups of at most kGemmRows, as even as possible (9 rows: 5 + 4, not 8 + 1)
  const int64_t groups = (rows + kGemmRows - 1) / kGemmRows;
  // the units of work: tiles, or (rows_act) pairs of a gate tile and its up tile, taken together
  const int64_t per_item = a.act >= 0 ? 2 : 1;
  const int64_t items = (a.n + 16 * kGemmCols - 1) / (16 * kGemmCols) / per_item;
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (per_item * a.k / 2 * step_bytes(kCodes)));
  auto pass = [&](int64_t begin, int64_t end) {
    alignas(64) float gate[kGemmRows * kGemmCols * 16];   // rows_act: a gate tile's results
    for (int64_t first = begin; first < end; first += panel)
      for (int64_t g = 0, r0 = 0; g < groups; ++g) {
        const int64_t size = (rows - r0) / (groups - g);
        for (int64_t item = first; item < std::min(end, first + panel); ++item) {
          dispatch_rows<kGemmCols, kCodes, kOffsets>(static_cast<int>(size), a, r0, item, gate);
          if (per_item == 2)
            dispatch_rows<kGemmCols, kCodes, kOffsets>(static_cast<int>(size), a, r0, item + a.half_tiles, gate);
        }
        r0 += size;
      }
    if (a.stream) _mm_sfence();   // the non-temporal stores are seen before the call returns
  };
  if (groups == 1) {
    // a few rows read the codes once, as fast as memory gives them: each thread's half in one run
    // (units cost 1-6% at one row, the weights coming from memory: AMD Zen 5 VM)
    at::parallel_for(0, items, 1, pass);
  } else {
    // at least kUnitsPerThread units a thread, of at most a panel, from a shared counter: a thread
    // that loses its core to another process (the HTTP front end, a client) holds up one unit, not its
    // half of the call (servelm_parallel.h; the LM head at 32 rows beside a process busy 3 ms in 23:
    // 21.2-21.4 -> 19.4-19.8 ms, quiet within 2%)
    servelm_parallel::dynamic_for(items, servelm_parallel::units_for(items, kUnitsPerThread, 1, panel), pass);
  }
}

template <Codes kCodes>
void run_form(const GemmArgs& a, int64_t rows, bool has_offsets) {
  if (has_offsets) run_gemm<kCodes, true>(a, rows);
  else run_gemm<kCodes, false>(a, rows);
}

// ---------------------------------------------------------------------------------------------
// amx_gemm: the product of the dense bf16 copy, x @ bf16(code x scale + offset).T, on Intel AMX tiles and
// the rows kernel's copies (the ``amx`` route, gguf_routes.py): no weight is read at 2 bytes. Per tile of 32
// outputs, the whole K of both 16-output vectors is widened once into a per-thread buffer (widening a span
// of 512 inputs at a time, in L1 while the rows passed, was no faster): each pair
// step as micro_tile widens it (bf16 of code + code_bias), then in float32 the code times its block's scale
// plus its offset, rounded to bf16 as torch rounds the dense copy (the same float32 operations, so the
// same bf16 weights but for denormals, which the conversion flushes). The buffer's rows are the B
// tiles tdpbf16ps takes (a row per input pair: 16 outputs' two weights); x, padded with zero rows to
// whole tiles of 16, gives the A tiles; a C tile of 16 rows x 16 outputs sums the whole K in float32
// (the tile unit's own order: the floats may differ from the dense GEMM's in their last bits, as any
// two GEMMs' do; a row's result reads only its own row of x, so it does not depend on the row count).
// The codes are prefetched into the caches (T0), never as non-temporal lines (those made the pass 1.36x
// slower on an Intel Xeon with AMX). Compiled for AMX by function attribute (the rest of the file does not
// need it); Python calls it only where ``amx_permitted`` (CPUID's AMX-TILE and AMX-BF16, and the tile state
// granted by Linux: servelm_amx.h).
namespace amx {

constexpr int64_t kRowTile = 16;   // rows of an A tile (and of a C tile)
constexpr int64_t kChunk = 32;     // inputs a tdpbf16ps takes (16 pairs: the rows of a B tile)

using servelm_amx::TileConfig;

// Tiles: C(i, c) = 2 i + c (row tile i of the pair taken together, output vector c), A(i) = 4 + i, B(c) = 6 + c;
// every one 16 rows of 64 bytes.
inline TileConfig config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kRowTile;
  return cfg;
}

// The weights of ``tile`` (2 vectors of 16 outputs) as bf16, [K / 2][2][32]: pair p of vector c at (2 p + c),
// its 16 columns (an output's two weights each) in the order ``kColumns``. A pair vector's 32 bf16 (code +
// code_bias) go to float32 by interleaving with zeros (the bf16 bits become the high half of a float's:
// the same value), which takes elements 0-3, 8-11, 16-19, 24-27 (low) and 4-7, 12-15, ... (high): no
// shifts or lane crossings, the scales permuted to match once a block, and the packed result's columns
// permuted (outputs kColumns[n]), which the epilogue undoes once a row (``kUnpermute``).
constexpr int kColumns[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
template <Codes kCodes, bool kOffsets>
inline void widen_tile(const GemmArgs& a, int64_t tile, __m512i* out) {
  constexpr int C = 2;
  const int64_t nb = a.k / a.block, per_block = a.block / 2;
  // the output of each float lane: low half element 8 (l / 4) + l % 4, high half 4 more; an output per pair
  const __m512i low = _mm512_setr_epi32(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(2));
  const __m512 bias = _mm512_set1_ps(code_bias(kCodes));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s[C][2], o[C][2];
    for (int c = 0; c < C; ++c) {
      const __m512 sv = block_scales(a, a.scales, tile, b, c, C, nb);
      s[c][0] = _mm512_permutexvar_ps(low, sv);
      s[c][1] = _mm512_permutexvar_ps(high, sv);
      if constexpr (kOffsets) {
        const __m512 ov = block_scales(a, a.offsets, tile, b, c, C, nb);
        o[c][0] = _mm512_permutexvar_ps(low, ov);
        o[c][1] = _mm512_permutexvar_ps(high, ov);
      }
    }
    for (int64_t p = b * per_block; p < (b + 1) * per_block; ++p) {
      __m512bh w[C];
      load_pair<C, kCodes>(a, tile, p, w);
      for (int c = 0; c < C; ++c) {
        const __m512i bits = reinterpret_cast<__m512i>(w[c]);
        __m512 f[2];
        for (int h = 0; h < 2; ++h) {   // the code (exact), times the scale, plus the offset, as torch's dense copy
          const __m512 v = _mm512_castsi512_ps(h == 0 ? _mm512_unpacklo_epi16(zero, bits) : _mm512_unpackhi_epi16(zero, bits));
          f[h] = _mm512_mul_ps(kCodes == Codes::kInt8 ? v : _mm512_sub_ps(v, bias), s[c][h]);
          if constexpr (kOffsets) f[h] = _mm512_add_ps(f[h], o[c][h]);
        }
        _mm512_store_si512(out + 2 * p + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0])));
      }
    }
  }
}

// Tiles [begin, end) of the work units (``per_item`` 2: rows_act's gate tile, then its up tile) for every row.
template <Codes kCodes, bool kOffsets>
__attribute__((target("amx-tile,amx-bf16"))) void pass(const GemmArgs& a, const uint16_t* xpad, int64_t rows,
                                                        int64_t begin, int64_t end, int64_t per_item) {
  constexpr int C = 2;
  const int64_t row_tiles = (rows + kRowTile - 1) / kRowTile, chunks = a.k / kChunk;
  const TileConfig cfg = config();
  _tile_loadconfig(&cfg);
  std::vector<__m512i> weights(a.k);   // [K / 2][2] vectors of 32 bf16
  alignas(64) float cbuf[4][kRowTile][16];
  std::vector<float> gate(a.act >= 0 ? rows * C * 16 : 0);   // rows_act: each row's gate results
  alignas(64) int32_t at[16];   // output o's column: where kColumns holds o
  for (int n = 0; n < 16; ++n) at[kColumns[n]] = n;
  const __m512i unpermute = _mm512_load_si512(at);
  for (int64_t item = begin; item < end; ++item)
    for (int64_t part = 0; part < per_item; ++part) {
      const int64_t tile = item + part * a.half_tiles;
      widen_tile<kCodes, kOffsets>(a, tile, weights.data());
      const char* w = reinterpret_cast<const char*>(weights.data());
      for (int64_t rt = 0; rt < row_tiles; rt += 2) {
        const bool two = rt + 1 < row_tiles;
        const uint16_t* x0 = xpad + rt * kRowTile * a.k;
        _tile_zero(0);
        _tile_zero(1);
        if (two) { _tile_zero(2); _tile_zero(3); }
        for (int64_t j = 0; j < chunks; ++j) {
          _tile_loadd(6, w + j * 16 * 128, 128);
          _tile_loadd(7, w + j * 16 * 128 + 64, 128);
          _tile_loadd(4, x0 + j * kChunk, a.k * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x0 + kRowTile * a.k + j * kChunk, a.k * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        if (two) { _tile_stored(2, cbuf[2], 64); _tile_stored(3, cbuf[3], 64); }
        for (int i = 0; i < (two ? 2 : 1); ++i)
          for (int64_t r = 0; r < kRowTile; ++r) {
            const int64_t row = (rt + i) * kRowTile + r;
            if (row >= rows) break;
            __m512 v[1][C];
            for (int c = 0; c < C; ++c) v[0][c] = _mm512_permutexvar_ps(unpermute, _mm512_load_ps(cbuf[2 * i + c][r]));
            if (a.act >= 0) act_epilogue<1, C>(a, v, row, tile, gate.data() + row * C * 16);
            else store_rows<1, C>(a, v, row, tile);
          }
      }
    }
  if (a.stream) _mm_sfence();
  _tile_release();
}

template <Codes kCodes, bool kOffsets>
void run(const GemmArgs& a, int64_t rows) {
  const int64_t row_tiles = (rows + kRowTile - 1) / kRowTile;
  std::vector<uint16_t> xpad(row_tiles * kRowTile * a.k, 0);   // x, then zero rows to whole tiles
  std::memcpy(xpad.data(), a.x, rows * a.k * sizeof(uint16_t));
  const int64_t per_item = a.act >= 0 ? 2 : 1;
  const int64_t items = (a.n + 16 * kGemmCols - 1) / (16 * kGemmCols) / per_item;
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (per_item * a.k / 2 * step_bytes(kCodes)));
  servelm_parallel::dynamic_for(items, servelm_parallel::units_for(items, kUnitsPerThread, 1, panel),
                                [&](int64_t begin, int64_t end) { pass<kCodes, kOffsets>(a, xpad.data(), rows, begin, end, per_item); });
}

template <Codes kCodes>
void run_form(const GemmArgs& a, int64_t rows, bool has_offsets) {
  if (has_offsets) run<kCodes, true>(a, rows);
  else run<kCodes, false>(a, rows);
}

// Whether this process may use AMX bf16 tiles: the CPU has them (CPUID leaf 7: AMX-BF16, EDX bit 22; AMX-TILE,
// bit 24) and Linux granted the process the tile state (asked once; a kernel before 5.16 has no such request).
bool permitted() {
  static const bool ok = servelm_amx::granted(servelm_amx::kTile | servelm_amx::kBf16);
  return ok;
}

}  // namespace amx

}  // namespace

// Python: rows_gemm(x, codes, scales, offsets, block, bf16_out=False, n=-1, bias=None): x [M, K] bfloat16;
// codes, scales, offsets packed as above (``pack``); n outputs (-1: every packed one, padding included);
// bias [N] float32 or bfloat16, added in float32 before the rounding (as torch's ``out + bias`` then
// ``.to(bfloat16)``). Returns [M, n] float32 (bfloat16 when bf16_out). ``rows_call``: the same in a
// prepared decode call's argument order (gguf_linear.py ``PreparedCall``: no n, the bias last).
//
// With ``act`` 0 (SiLU) or 1 (GELU tanh): a gated MLP's gate_up (gate the first n / 2 outputs, up the
// rest; every packed output, n / 2 a multiple of the tile) and its act(gate) * up in one call, as
// gate_up's bf16 output then fused_ops' act_and_mul would give them, bit for bit: [M, n / 2] bfloat16
// (bf16_out, no bias). Each gate tile is computed with the up tile of the same outputs, so the
// [M, n] gate_up never goes to memory and act_and_mul's call goes: ``rows_act``.
torch::Tensor gemm_on(bool on_amx, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                      c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out, int64_t n,
                      c10::optional<torch::Tensor> bias, int64_t act) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % block == 0, "K must be a multiple of the block");
  if (n < 0) n = codes.dim() >= 3 ? codes.size(0) * kGemmCols * 16 : 0;
  // the form: int8 or biased uint8 [tiles, K / 2, 2, 16, 2], or packed uint8 [tiles, K / 2, 32, 40 or 48]
  const bool packed = codes.dim() == 3 && codes.dtype() == torch::kUInt8;
  const Codes form = packed ? (codes.size(2) == 32 ? Codes::kNibbles : codes.size(2) == 40 ? Codes::kFiveBits
                                                                                          : Codes::kSixBits)
                            : codes.dtype() == torch::kUInt8 ? Codes::kBiased : Codes::kInt8;
  TORCH_CHECK(codes.is_contiguous() && codes.size(0) * kGemmCols * 16 >= n && codes.dim() >= 3 && codes.size(1) == k / 2
              && (packed ? codes.size(2) == 32 || codes.size(2) == 40 || codes.size(2) == 48
                         : (codes.dtype() == torch::kUInt8 || codes.dtype() == torch::kInt8) && codes.dim() == 5
                           && codes.size(2) == kGemmCols && codes.size(3) == 16 && codes.size(4) == 2),
              "codes: packed int8 or biased uint8 [tiles, K / 2, ", kGemmCols, ", 16, 2], or uint8 nibbles "
              "[tiles, K / 2, 32, 40 or 48]");
  const bool sub_scaled = scales.dtype() == torch::kInt8;
  TORCH_CHECK((scales.dtype() == torch::kFloat32 || scales.dtype() == torch::kFloat16 || sub_scaled)
              && scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == codes.size(0)
              && scales.size(1) == k / block + (sub_scaled ? 4 * (k / 256) : 0) && scales.size(2) == kGemmCols
              && scales.size(3) == 16 && (!sub_scaled || k % 256 == 0),
              "scales: packed float32 or float16 [tiles, K / block, ", kGemmCols, ", 16], or int8 sub-scales and "
              "their multipliers [tiles, K / block + 4 K / 256, ", kGemmCols, ", 16] (K a multiple of 256)");
  const bool has_offsets = checked_offsets(offsets, scales);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || ((bias->dtype() == torch::kFloat32 || bias->dtype() == torch::kBFloat16) && bias->dim() == 1
                            && bias->is_contiguous() && bias->size(0) >= n),
              "bias: contiguous float32 or bfloat16 [N]");
  constexpr int64_t kTileOutputs = kGemmCols * 16;
  TORCH_CHECK(act >= -1 && act <= 1, "act: -1 (none), 0 (SiLU) or 1 (GELU tanh)");
  TORCH_CHECK(act < 0 || (bf16_out && !has_bias && n == codes.size(0) * kTileOutputs && n % (2 * kTileOutputs) == 0),
              "act: bf16 output, no bias, every packed output, the gate half whole tiles");
  auto out = torch::empty({rows, act >= 0 ? n / 2 : n}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  if (rows == 0 || n == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const std::vector<float> sums = has_offsets || form != Codes::kInt8 ? block_sums(xp, rows, k, block)
                                                                      : std::vector<float>();
  GemmArgs a{xp, codes.data_ptr(), scales.data_ptr(), has_offsets ? offsets->data_ptr() : nullptr,
             sums.data(), k, n, block, bf16_out ? nullptr : out.data_ptr<float>(),
             bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr, false,
             sub_scaled ? kSubScales : scales.dtype() == torch::kFloat16 ? kF16Scales : kF32Scales,
             // one row group (run_gemm): each code read once, prefetched non-temporal where that measured faster
             !on_amx && rows <= kGemmRows && nta_prefetch.load(std::memory_order_relaxed),
             has_bias && bias->dtype() == torch::kFloat32 ? bias->data_ptr<float>() : nullptr,
             has_bias && bias->dtype() == torch::kBFloat16 ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
             static_cast<int>(act), n / 2 / kTileOutputs};
  // a large float32 result (the LM head's logits: 32 MiB at 32 rows) bypasses the caches: written
  // through them, its rows 1 MiB apart fall into the same L1 sets and cost a quarter of the time
  a.stream = a.yf != nullptr && rows * n * 4 >= kStreamBytes && n % 16 == 0
             && reinterpret_cast<uintptr_t>(a.yf) % 64 == 0;
  if (on_amx) {
    TORCH_CHECK(k % amx::kChunk == 0, "amx_gemm: K must be a multiple of ", amx::kChunk);
    TORCH_CHECK(amx::permitted(), "amx_gemm: the kernel did not grant this process the AMX tile state");
    switch (form) {
      case Codes::kBiased: amx::run_form<Codes::kBiased>(a, rows, has_offsets); break;
      case Codes::kNibbles: amx::run_form<Codes::kNibbles>(a, rows, has_offsets); break;
      case Codes::kFiveBits: amx::run_form<Codes::kFiveBits>(a, rows, has_offsets); break;
      case Codes::kSixBits: amx::run_form<Codes::kSixBits>(a, rows, has_offsets); break;
      default: amx::run_form<Codes::kInt8>(a, rows, has_offsets);
    }
    return out;
  }
  switch (form) {
    case Codes::kBiased: run_form<Codes::kBiased>(a, rows, has_offsets); break;
    case Codes::kNibbles: run_form<Codes::kNibbles>(a, rows, has_offsets); break;
    case Codes::kFiveBits: run_form<Codes::kFiveBits>(a, rows, has_offsets); break;
    case Codes::kSixBits: run_form<Codes::kSixBits>(a, rows, has_offsets); break;
    default: run_form<Codes::kInt8>(a, rows, has_offsets);
  }
  return out;
}

torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out, int64_t n,
                        c10::optional<torch::Tensor> bias, int64_t act) {
  return gemm_on(false, x, codes, scales, offsets, block, bf16_out, n, bias, act);
}

// Python: amx_gemm(...): rows_gemm's arguments and result on AMX tiles (``amx`` above); amx_permitted():
// whether the process may use them (CPUID's AMX-TILE and AMX-BF16, the tile state granted: servelm_amx.h).
torch::Tensor amx_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                       c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out, int64_t n,
                       c10::optional<torch::Tensor> bias, int64_t act) {
  return gemm_on(true, x, codes, scales, offsets, block, bf16_out, n, bias, act);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear,
        "x [M, K] bfloat16 @ block-quantized W [N, K] -> [M, N] float32 (bfloat16 when bf16_out): "
        "weights widened to bf16 once per call, vdpbf16ps against every row, scales in float32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false);
  m.def("rows_gemm", &rows_gemm,
        "x [M, K] bfloat16 @ block-quantized W packed in VNNI order -> [M, n] float32 (bfloat16 when "
        "bf16_out): an accumulator block of rows x 32 outputs, scales per block in float32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false, py::arg("n") = -1, py::arg("bias") = py::none(), py::arg("act") = -1);
  m.def("amx_gemm", &amx_gemm,
        "rows_gemm on AMX tiles (bf16 tiles of each block's widened codes; scales per block in float32)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false, py::arg("n") = -1, py::arg("bias") = py::none(), py::arg("act") = -1);
  m.def("amx_permitted", &amx::permitted, "whether the kernel granted this process the AMX tile state");
  m.def("set_nta_prefetch", [](bool on) { nta_prefetch.store(on); },
        "whether a call of one row group prefetches its codes non-temporal (else into every cache level)",
        py::arg("on"));
  m.def("nta_prefetch", [] { return nta_prefetch.load(); }, "set_nta_prefetch's setting");
  m.def("rows_call",
        [](torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
           int64_t block, bool bf16_out, c10::optional<torch::Tensor> bias) {
          return rows_gemm(x, codes, scales, offsets, block, bf16_out, -1, bias, -1);
        },
        "rows_gemm over every packed output in a prepared decode call's argument order (x, codes, scales, "
        "offsets, block, bf16_out[, bias])",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false, py::arg("bias") = py::none());
  m.def("rows_act",
        [](torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
           int64_t block, int64_t act) {
          return rows_gemm(x, codes, scales, offsets, block, true, -1, c10::nullopt, act);
        },
        "a gated MLP's gate_up (packed as for rows_gemm, gate then up) and act(gate) * up in one call: "
        "[M, N / 2] bfloat16, the bits of gate_up's bf16 output then act_and_mul (act 0 SiLU, 1 GELU tanh)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"), py::arg("act"));
  m.attr("GEMM_COLS") = kGemmCols;
}
