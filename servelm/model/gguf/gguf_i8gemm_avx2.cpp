// int8 x int8 GEMM on GGUF block codes for CPUs with AVX2 + FMA and no VNNI (AMD Zen 1-3, most
// desktops and laptops): the arithmetic of gguf_i8gemm.cpp, y[M, N] = x[M, K] @ W.T with
//   W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]),   B = 16 or 32,
// x rounded per row and block of B inputs to int8 as llama.cpp's Q8_0 does (d = absmax / 127,
// q = round(x / d), nearest even, |q| <= 127), each block's integer dot exact in int32, then
//   y[m, n] = sum_b float(dot_b) * (scales[n, b] * d[m, b])  (+ offsets[n, b] * (d[m, b] * sum_k q[m, k]))
// in that order: the floats of the VNNI kernel, on another instruction set.
//
// vpmaddubsw multiplies unsigned by signed bytes and adds each pair into a *saturating* int16: the
// weights are the unsigned side, stored at load as u = code + bias (``pack_avx2`` in gguf_i8gemm.py,
// bias = -min code), so sum u q = dot + bias sum q and a block's int32 accumulators start at
// -bias sum q. A pair is at most 2 * umax * 127 (umax = the largest u): exact where umax <= 127; where
// umax <= 63 (Q4, Q5 and Q6 codes) two pairs' int16 sums are added before they are widened (kPairs
// 2: at most 32,004), one vpmaddwd for two vpmaddubsw. The GEMM routes never pack a weight whose
// codes span more than 127 (Q8_0: the caller keeps its other routes).
//
// Fewer activation levels (``levels`` L < 127: d = absmax / L, |q| <= L) make room for wider codes:
// a pair is at most 2 * umax * L, so Q8_0's u = code + 127 <= 254 takes L = 64 (one pair at a time)
// or 32 (two). The LM head's screen (``i8_screen``) runs so: its results only choose candidates,
// within a bound that counts the coarser rounding (lm_head_screen.py ``i8_screen_coefficient``).
// Packed copy, per tile of 16 outputs:
//   codes  [T, K / 4, 1, 16, 4] uint8: per tile and 4 inputs, 16 outputs' 4 bytes (two vectors of 8
//          outputs; one sequential stream per tile); N padded to whole tiles with zero codes (u = bias)
//   scales [T, K / B, 1, 16] float32 (offsets alike; zero for padded outputs)
// Lanes are outputs: the activation's 4 bytes are broadcast, so there is no horizontal sum.
// Each row's arithmetic does not depend on the other rows or the row count.
//
// Compiled at run time by servelm/model/gguf/gguf_i8gemm.py with -mavx2 -mfma; the Python side checks
// those CPU flags first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "servelm_i8gemm.h"
#include "servelm_vec.h"

namespace {

constexpr int64_t kTile = 16;             // outputs per tile: two vectors of 8
constexpr int kRows = 4;                  // most rows per accumulator block: 8 int32 accumulators + 4 weight vectors
constexpr int64_t kPanelBytes = 256 << 10;   // activation codes of one row panel, kept in L2 while tiles pass
constexpr int64_t kChunkBytes = 192 << 10;   // weight codes every row group of a panel passes before the next
constexpr int64_t kPrefetchBytes = 1024;     // how far ahead of the tile's code stream to prefetch

using servelm_i8gemm::Buffer;
using servelm_i8gemm::ScreenState;
namespace vec = servelm_vec::vec;

// Activation rows rounded to int8 per block, to ``levels`` steps each side of zero (see the top of the file).
struct Quantized {
  Buffer<int8_t> codes;     // [M, K]
  Buffer<float> scales;     // [M, K / B]: d
  Buffer<int32_t> counts;   // [M, K / B]: sum q
  Buffer<float> sums;       // [M, K / B]: d * sum q (weights with offsets only)
};

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Block b of row r (V vectors of 8 inputs), rounded as the file's top says.
template <int V, class T>
inline void quantize_block(const T* x, int64_t r, int64_t b, int64_t k, int64_t nb, bool with_sums, int levels,
                           Quantized& q) {
  constexpr int64_t kB = 8 * V;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[V];
  __m256 m = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  for (int i = 0; i < V; ++i) {
    v[i] = vec::load(x + r * k + b * kB + 8 * i);   // bf16 widened exactly
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  // a NaN makes the block's scale NaN (as torch's amax), so the outputs it reaches are NaN: vmaxps
  // would drop it
  const float d = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN()
                                          : vec::max_lane(m) / static_cast<float>(levels);
  const float inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i sum = _mm256_setzero_si256();
  int8_t* out = q.codes.data() + r * k + b * kB;
  for (int i = 0; i < V; i += 2) {   // 16 inputs at a time: int32 -> int16 -> int8, in order
    __m256i c[2];
    for (int j = 0; j < 2; ++j) {
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + j], scale));   // nearest even
      c[j] = _mm256_max_epi32(_mm256_min_epi32(c[j], _mm256_set1_epi32(levels)), _mm256_set1_epi32(-levels));
      sum = _mm256_add_epi32(sum, c[j]);
    }
    const __m256i half = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * i),
                     _mm_packs_epi16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1)));
  }
  const int32_t s = sum_lanes(sum);
  q.scales[r * nb + b] = d;
  q.counts[r * nb + b] = s;
  if (with_sums) q.sums[r * nb + b] = d * static_cast<float>(s);
}

template <class T>
Quantized quantize_rows(const T* x, int64_t rows, int64_t k, int64_t block, bool with_sums, int levels) {
  const int64_t nb = k / block;
  Quantized q{Buffer<int8_t>(rows * k), Buffer<float>(rows * nb), Buffer<int32_t>(rows * nb),
              Buffer<float>(with_sums ? rows * nb : 0)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        if (block == 32) quantize_block<4>(x, r, b, k, nb, with_sums, levels, q);
        else quantize_block<2>(x, r, b, k, nb, with_sums, levels, q);
      }
  });
  return q;
}

struct GemmArgs {
  const Quantized* x;
  const uint8_t* codes;    // packed, see above
  const float* scales;     // packed
  const float* offsets;    // packed or nullptr
  int32_t code_bias;       // u = code + code_bias
  int64_t k, n, nb;
  float* yf;               // [M, ldy] float32 out, or
  uint16_t* yb;            // bf16 out
  int64_t ldy;             // the output's row stride
  const float* bias32;     // [n] added to the results in float32 before any rounding, or nullptr;
  const uint16_t* bias16;  // or a bf16 bias (widened exactly), or nullptr
};

// float32 -> bf16 rounded to nearest even, as torch (NaN stays a NaN)
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  return _mm256_castsi256_si128(packed);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_set1_epi32(word);
}

// The screen's epilogue of one accumulator block (i8_screen): each row's lower bounds S - E raise its running
// largest one, and the outputs whose upper bound S + E reaches it are kept (ascending: a thread's tiles
// ascend for every row). Padded outputs (beyond n) take part in neither.
template <int R>
void screen_tile(const __m256 (&acc)[R][2], const GemmArgs& a, ScreenState& st, int64_t r0, int64_t tile) {
  int valid[2];
  __m256 per_output[2][2], in[2];   // in: the lanes of real outputs
  for (int c = 0; c < 2; ++c) {
    const int64_t n0 = tile * kTile + c * 8;
    valid[c] = static_cast<int>(std::clamp<int64_t>(a.n - n0, 0, 8));
    in[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid[c]),
                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    alignas(32) float most[8] = {}, sum[8] = {};
    if (valid[c] > 0) {
      std::memcpy(most, st.bound_max + n0, valid[c] * sizeof(float));
      std::memcpy(sum, st.bound_sum + n0, valid[c] * sizeof(float));
    }
    per_output[c][0] = _mm256_load_ps(most);
    per_output[c][1] = _mm256_load_ps(sum);
  }
  const __m256 below = _mm256_set1_ps(-INFINITY);
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const __m256 row_sum = _mm256_set1_ps(st.row_sum[row]), row_max = _mm256_set1_ps(st.row_max[row]);
    __m256 upper[2];
    __m256 lowest = below;
    for (int c = 0; c < 2; ++c) {
      const __m256 e = _mm256_min_ps(_mm256_mul_ps(row_sum, per_output[c][0]), _mm256_mul_ps(row_max, per_output[c][1]));
      upper[c] = _mm256_add_ps(acc[r][c], e);
      lowest = _mm256_max_ps(lowest, _mm256_blendv_ps(below, _mm256_sub_ps(acc[r][c], e), in[c]));
    }
    const float lower = std::max(st.lower[row], vec::max_lane(lowest));
    st.lower[row] = lower;
    for (int c = 0; c < 2; ++c) {
      unsigned hits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(upper[c], _mm256_set1_ps(lower), _CMP_GE_OQ)))
                      & ((1u << valid[c]) - 1);
      if (!hits) continue;
      alignas(32) float ups[8];
      _mm256_store_ps(ups, upper[c]);
      for (; hits; hits &= hits - 1) {
        const int lane = __builtin_ctz(hits);
        st.keep(row, static_cast<int32_t>(tile * kTile + c * 8 + lane), ups[lane]);
      }
    }
  }
}

// Rows r0 .. r0 + R - 1 against the kTile outputs of ``tile``: stored into y, or met by the screen's bounds
// (``screen``, i8_screen). kPairs: vpmaddubsw results added in int16 before vpmaddwd widens them (2 where
// 4 x umax x levels fits in int16, see the top).
template <int R, int B, int kPairs, bool kOffsets>
void micro_tile(const GemmArgs& a, int64_t r0, int64_t tile, ScreenState* screen) {
  constexpr int kGroups = B / 4;   // 4-input groups per block
  const int64_t nb = a.nb, k = a.k;
  const uint8_t* w = a.codes + tile * k * kTile;
  const float* ws = a.scales + tile * nb * kTile;
  const float* wo = kOffsets ? a.offsets + tile * nb * kTile : nullptr;
  const int8_t* xq = a.x->codes.data() + r0 * k;
  const float* xs = a.x->scales.data() + r0 * nb;
  const int32_t* xcount = a.x->counts.data() + r0 * nb;
  const float* xsum = kOffsets ? a.x->sums.data() + r0 * nb : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i t[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256i start = _mm256_set1_epi32(-a.code_bias * xcount[r * nb + b]);
      t[r][0] = t[r][1] = start;
    }
    const uint8_t* wb = w + b * B * kTile;
    _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetchBytes, _MM_HINT_T0);
    if constexpr (B == 32) _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetchBytes + 64, _MM_HINT_T0);
    for (int g = 0; g < kGroups; g += kPairs) {
      __m256i wv[kPairs][2];
      for (int p = 0; p < kPairs; ++p)
        for (int c = 0; c < 2; ++c) wv[p][c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (g + p) * 64 + 32 * c));
      for (int r = 0; r < R; ++r) {
        __m256i xv[kPairs];
        for (int p = 0; p < kPairs; ++p) xv[p] = broadcast4(xq + r * k + b * B + 4 * (g + p));
        for (int c = 0; c < 2; ++c) {
          __m256i pairs = _mm256_maddubs_epi16(wv[0][c], xv[0]);
          for (int p = 1; p < kPairs; ++p) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[p][c], xv[p]));
          t[r][c] = _mm256_add_epi32(t[r][c], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    __m256 sv[2], ov[2];
    for (int c = 0; c < 2; ++c) {
      sv[c] = _mm256_loadu_ps(ws + b * kTile + 8 * c);
      if constexpr (kOffsets) ov[c] = _mm256_loadu_ps(wo + b * kTile + 8 * c);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(xs[r * nb + b]);
      for (int c = 0; c < 2; ++c) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][c]), _mm256_mul_ps(sv[c], d), acc[r][c]);
        if constexpr (kOffsets) acc[r][c] = _mm256_fmadd_ps(ov[c], _mm256_set1_ps(xsum[r * nb + b]), acc[r][c]);
      }
    }
  }
  if (screen != nullptr) {
    screen_tile<R>(acc, a, *screen, r0, tile);
    return;
  }
  for (int c = 0; c < 2; ++c) {
    const int64_t n0 = tile * kTile + c * 8;
    if (n0 >= a.n) break;
    const int64_t width = std::min<int64_t>(8, a.n - n0);
    if (a.bias32 != nullptr || a.bias16 != nullptr) {   // torch's ``out + bias`` in float32, then any rounding
      alignas(32) float bias[8] = {};
      for (int64_t j = 0; j < width; ++j)
        bias[j] = a.bias32 != nullptr ? a.bias32[n0 + j] : [&] {
          const uint32_t bits = static_cast<uint32_t>(a.bias16[n0 + j]) << 16;
          float f;
          std::memcpy(&f, &bits, sizeof(f));
          return f;
        }();
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_load_ps(bias));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * a.ldy + n0;
      if (a.yf != nullptr) {
        if (width == 8) {
          _mm256_storeu_ps(a.yf + at, acc[r][c]);
        } else {
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, acc[r][c]);
          std::memcpy(a.yf + at, lanes, width * sizeof(float));
        }
      } else {
        alignas(16) uint16_t lanes[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), to_bf16(acc[r][c]));
        std::memcpy(a.yb + at, lanes, width * sizeof(uint16_t));
      }
    }
  }
}

template <int B, int kPairs, bool kOffsets, int R = kRows>
void dispatch_rows(int rows, const GemmArgs& a, int64_t r0, int64_t tile, ScreenState* screen) {
  if (rows == R || R == 1) {
    micro_tile<R, B, kPairs, kOffsets>(a, r0, tile, screen);
  } else if constexpr (R > 1) {
    dispatch_rows<B, kPairs, kOffsets, R - 1>(rows, a, r0, tile, screen);
  }
}

// Threads split the tiles. Each takes its tiles once per panel of rows (the panel's activation codes
// stay in L2 while the tiles pass), in chunks of kChunkBytes of codes that every row group of the panel
// passes over (from L2) before the next chunk. The rows of a panel go in groups of at most kRows, as
// even as possible (9 rows: 3 + 3 + 3). With ``screen`` (i8_screen), each thread meets its results with
// the bounds in its own ScreenState, and the states go to ``states`` with the first tile of the thread's range.
template <int B, int kPairs, bool kOffsets>
void run_gemm(const GemmArgs& a, int64_t rows, const ScreenState* screen = nullptr,
              std::vector<std::pair<int64_t, ScreenState>>* states = nullptr) {
  const int64_t tiles = (a.n + kTile - 1) / kTile;
  const int64_t panel = std::max<int64_t>(kRows, kPanelBytes / a.k / kRows * kRows);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (a.k * kTile));
  std::mutex states_mutex;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    ScreenState own = screen != nullptr ? screen->fresh(rows) : ScreenState{};
    ScreenState* state = screen != nullptr ? &own : nullptr;
    for (int64_t p0 = 0; p0 < rows; p0 += panel) {
      const int64_t size = std::min(panel, rows - p0);
      const int64_t groups = (size + kRows - 1) / kRows;
      for (int64_t first = begin; first < end; first += chunk) {
        for (int64_t g = 0, r0 = p0; g < groups; ++g) {
          const int64_t group = (p0 + size - r0) / (groups - g);
          for (int64_t tile = first; tile < std::min(end, first + chunk); ++tile)
            dispatch_rows<B, kPairs, kOffsets>(static_cast<int>(group), a, r0, tile, state);
          r0 += group;
        }
      }
    }
    if (state != nullptr) {
      std::lock_guard<std::mutex> lock(states_mutex);
      states->emplace_back(begin, std::move(own));
    }
  });
}

template <int B>
void run_block(const GemmArgs& a, int64_t rows, int pairs) {
  if (a.offsets != nullptr) {
    if (pairs == 2) run_gemm<B, 2, true>(a, rows);
    else run_gemm<B, 1, true>(a, rows);
  } else {
    if (pairs == 2) run_gemm<B, 2, false>(a, rows);
    else run_gemm<B, 1, false>(a, rows);
  }
}

// The packed codes' bias and span and the activations' levels checked (u = code + code_bias in 0 .. code_span,
// |q| <= levels, two products within int16), and the vpmaddubsw pairs added in int16 before widening: 2 where
// four products fit, else 1.
int pairs_for(int64_t code_bias, int64_t code_span, int64_t levels) {
  TORCH_CHECK(levels >= 1 && levels <= 127, "levels: 1 .. 127");
  TORCH_CHECK(code_span >= 0 && 2 * code_span * levels <= 32767,
              "code_span: the packed codes' largest value, with levels at most 32767 / (2 x levels)");
  TORCH_CHECK(code_bias >= 0 && code_bias <= code_span, "code_bias: 0 .. code_span");
  return 4 * code_span * levels <= 32767 ? 2 : 1;
}

}  // namespace

// Python: i8_gemm(x, codes, scales, offsets, block, bf16_out=False, n=-1, out=None, bias=None, *, code_bias,
// code_span, levels=127): x [M, K] bfloat16 or float32, rounded to ``levels`` steps each side; codes (u = code +
// code_bias, at most code_span), scales, offsets packed as above; n outputs (-1: every packed one). Returns
// [M, n] float32 (bfloat16 when bf16_out), written into ``out`` when given (contiguous rows of that dtype,
// [M, >= n]); ``bias`` (float32 or bfloat16 [n]) added in float32 before the rounding to bfloat16, as
// ``(float32 result + bias).to(bfloat16)``.
torch::Tensor i8_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                      int64_t block, bool bf16_out, int64_t n, c10::optional<torch::Tensor> out,
                      c10::optional<torch::Tensor> bias, int64_t code_bias, int64_t code_span, int64_t levels) {
  torch::Tensor y = servelm_i8gemm::gemm_output(x, codes, scales, offsets, block, bf16_out, n, out, bias, 1);
  const int pairs = pairs_for(code_bias, code_span, levels);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / block;
  const bool has_offsets = offsets.has_value() && offsets->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if (rows == 0 || n == 0) return y;
  const Quantized q = x.dtype() == torch::kFloat32
      ? quantize_rows(x.data_ptr<float>(), rows, k, block, has_offsets, static_cast<int>(levels))
      : quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, k, block, has_offsets,
                      static_cast<int>(levels));
  GemmArgs a{&q, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
             has_offsets ? offsets->data_ptr<float>() : nullptr, static_cast<int32_t>(code_bias), k, n, nb,
             bf16_out ? nullptr : y.data_ptr<float>(),
             bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr, y.stride(0),
             has_bias && bias->dtype() == torch::kFloat32 ? bias->data_ptr<float>() : nullptr,
             has_bias && bias->dtype() == torch::kBFloat16 ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr};
  if (block == 32) run_block<32>(a, rows, pairs);
  else run_block<16>(a, rows, pairs);
  return y;
}

// Python: i8_screen(x, codes, scales, n, bound_max, bound_sum, coefficient, max_candidates, *, code_bias,
// code_span, levels) -> [counts (int64 [M]), then per row its candidate ids (int64, ascending; empty where the
// count exceeds max_candidates)]: the exact greedy LM-head screen for many rows (lm_head_screen.py
// ``I8Screen``) on a Q8_0 head packed as for i8_gemm (u = code + code_bias), the activations rounded to
// ``levels`` steps (64 or 32 for Q8_0's codes, see the top). The candidates of a row are the outputs whose
// S + E reaches max over v of S - E, S this GEMM's result and E = min(row_sum[m] bound_max[v], row_max[m]
// bound_sum[v]) with row_sum, row_max the coefficient times the sum and the max over blocks of the row's
// absmax (= levels d): the derivation at gguf_i8gemm.cpp's ``i8_screen``, whose bound this is with this
// rounding's step in the coefficient. A row with a value that is not finite has none (count 0).
std::vector<torch::Tensor> i8_screen(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t n,
                                     torch::Tensor bound_max, torch::Tensor bound_sum, double coefficient,
                                     int64_t max_candidates, int64_t code_bias, int64_t code_span, int64_t levels) {
  servelm_i8gemm::check_screen_args(x, codes, scales, n, bound_max, bound_sum, 1);
  const int pairs = pairs_for(code_bias, code_span, levels);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / 32;
  std::vector<std::pair<int64_t, ScreenState>> states;
  if (rows == 0) return servelm_i8gemm::screen_candidates(states, 0, {}, max_candidates);
  const float* xp = x.data_ptr<float>();
  const std::vector<bool> finite = servelm_i8gemm::finite_rows(xp, rows, k);
  const Quantized q = quantize_rows(xp, rows, k, 32, false, static_cast<int>(levels));
  std::vector<float> row_sum, row_max;
  servelm_i8gemm::screen_row_bounds(q.scales.data(), rows, nb, static_cast<float>(levels),
                                    static_cast<float>(coefficient), row_sum, row_max);
  GemmArgs a{&q, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, static_cast<int32_t>(code_bias), k, n,
             nb, nullptr, nullptr, 0, nullptr, nullptr};
  const ScreenState screen = ScreenState::over(bound_max, bound_sum, row_sum, row_max);
  if (pairs == 2) run_gemm<32, 2, false>(a, rows, &screen, &states);
  else run_gemm<32, 1, false>(a, rows, &screen, &states);
  return servelm_i8gemm::screen_candidates(states, rows, finite, max_candidates);
}

// Python: quantize(x, block, levels=127) -> (codes int8 [M, K], scales float32 [M, K / block]): the activation
// rounding i8_gemm applies, for tests and references.
std::vector<torch::Tensor> quantize(torch::Tensor x, int64_t block, int64_t levels) {
  TORCH_CHECK(levels >= 1 && levels <= 127, "levels: 1 .. 127");
  return servelm_i8gemm::quantized_tensors(x, block, [block, levels](const auto* data, int64_t rows, int64_t k) {
    return quantize_rows(data, rows, k, block, false, static_cast<int>(levels));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("i8_gemm", &i8_gemm,
        "x [M, K] (bfloat16 or float32, rounded to int8 per block) @ block-quantized W packed for vpmaddubsw "
        "-> [M, n] float32 (bfloat16 when bf16_out), into out when given",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false, py::arg("n") = -1, py::arg("out") = py::none(), py::arg("bias") = py::none(),
        py::kw_only(), py::arg("code_bias"), py::arg("code_span"), py::arg("levels") = 127);
  m.def("i8_screen", &i8_screen,
        "the exact greedy screen of a Q8_0 LM head for many rows: (counts [M], then each row's candidate ids)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bound_max"), py::arg("bound_sum"),
        py::arg("coefficient"), py::arg("max_candidates"), py::kw_only(), py::arg("code_bias"), py::arg("code_span"),
        py::arg("levels"));
  m.def("quantize", &quantize, "x [M, K] -> (int8 codes [M, K], float32 scales [M, K / block])",
        py::arg("x"), py::arg("block"), py::arg("levels") = 127);
  m.attr("GEMM_COLS") = 1;
  m.attr("GEMM_ROWS") = kRows;
}
