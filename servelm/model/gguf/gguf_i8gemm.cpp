// int8 x int8 GEMM on GGUF block codes (AVX512-VNNI): y[M, N] = x[M, K] @ W.T with
//   W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]),   B = 16 or 32, |codes| <= 128,
// and x rounded per row and block of B inputs to int8 as llama.cpp's Q8_0 does:
//   d = absmax / 127, q = round(x / d) (nearest even), x ~ q * d.
// Per block the integer dot sum_k q[m, k] codes[n, k] is exact in int32; the result is
//   y[m, n] = sum_b float(dot_b) * (scales[n, b] * d[m, b])  (+ offsets[n, b] * d[m, b] * sum_k q[m, k]).
//
// vpdpbusd multiplies unsigned by signed bytes. The weights are the unsigned side, stored at load as
// u = code + 128 (``pack`` in gguf_i8gemm.py): sum u q = dot + 128 sum q, so a block's int32
// accumulators start at -128 sum q (one value per activation row and block, made when x is
// quantized) and end at the exact dot. Packed copy, per tile of 32 outputs (kCols vectors of 16):
//   codes  [T, K / 4, kCols, 16, 4] uint8: per tile and 4 inputs, kCols vectors of 16 outputs' 4 bytes
//          (one sequential stream per tile); N padded to whole tiles with zero codes (u = 128)
//   scales [T, K / B, kCols, 16] float32 (offsets alike; zero for padded outputs)
// Lanes are outputs: the activation's 4 bytes are broadcast, so there is no horizontal sum.
// An accumulator block holds up to kRows rows x 32 outputs: int32 block sums plus float32 results.
// Each row's arithmetic does not depend on the other rows or the row count.
//
// Compiled at run time by servelm/model/gguf/gguf_i8gemm.py with -mavx512{f,bw,vl,vnni} only (no
// AVX512-BF16: it runs on Intel CPUs without it); the Python side checks those CPU flags first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "servelm_i8gemm.h"
#include "servelm_amx.h"
#include "servelm_simd.h"

namespace {

constexpr int kCols = 2;                  // 16-output vectors per tile
constexpr int64_t kTile = 16 * kCols;     // outputs per tile
constexpr int kRows = 4;   // most rows per accumulator block: 8 int32 + 8 float32 registers (6 spilled: 1.3x slower)
constexpr int64_t kPanelBytes = 256 << 10;   // activation codes of one row panel, kept in L2 while tiles pass
constexpr int64_t kChunkBytes = 320 << 10;   // weight codes every row group of a panel passes before the next
constexpr int64_t kStreamBytes = 4 << 20;    // float32 results at least this large: non-temporal stores
constexpr int64_t kPrefetchBytes = 2048;     // how far ahead of the tile's code stream to prefetch

using servelm_i8gemm::Buffer;

// Activation rows rounded to int8 per block (see the top of the file).
struct Quantized {
  Buffer<int8_t> codes;      // [M, K]
  Buffer<float> scales;      // [M, K / B]: d
  Buffer<int32_t> starts;    // [M, K / B]: -128 * sum q, the accumulators' start
  Buffer<float> sums;        // [M, K / B]: d * sum q (weights with offsets only)
};

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {   // bf16 -> float32, exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The 16 lanes of each of m[0..15] reduced with ``op`` (max or add; a tree of in-register
// shuffles, no horizontal reduction per vector): lane j of the result is m[j]'s reduction.
template <class Op>
inline __m512 reduce16(__m512 (&m)[16], Op op) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i)   // 128-bit quarters: [a0|a2, a1|a3, b0|b2, b1|b3]
    t[i] = op(_mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0x44), _mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0xEE));
  __m512 u[4];
  for (int i = 0; i < 4; ++i)   // quarter L of u[i]: four partials of vector 4 i + L
    u[i] = op(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  __m512 w[2];
  for (int i = 0; i < 2; ++i)   // quarter L of w[i]: two partials of vectors 8 i + L, 8 i + 4 + L
    w[i] = op(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4 L + p holds vector 4 p + L: back to lane j = vector j
  const __m512 r = op(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Blocks b0 .. b0 + count - 1 (count <= 16) of row r, V vectors of 16 inputs each, rounded as the
// file's top says; the per-block reductions (absmax, sum of codes) for all of them at once.
template <int V, class T>
inline void quantize_blocks(const T* x, int64_t r, int64_t b0, int count, int64_t k, int64_t nb, bool with_sums,
                            Quantized& q) {
  constexpr int64_t kB = 16 * V;
  __m512 v[16][V];
  __m512 m[16];
  for (int j = 0; j < 16; ++j) {
    m[j] = _mm512_setzero_ps();
    if (j >= count) continue;
    for (int i = 0; i < V; ++i) {
      v[j][i] = load16(x + r * k + (b0 + j) * kB + 16 * i);
      m[j] = _mm512_max_ps(m[j], _mm512_abs_ps(v[j][i]));
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  const __m512 d = _mm512_div_ps(reduce16(m, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }),
                                 _mm512_set1_ps(127.f));
  const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ),
                                         _mm512_set1_ps(1.f), d);
  alignas(64) float invs[16];
  _mm512_store_ps(invs, inv);
  _mm512_mask_storeu_ps(q.scales.data() + r * nb + b0, valid, d);
  __m512 sums[16];
  for (int j = 0; j < 16; ++j) {
    __m512i sum = _mm512_setzero_si512();
    if (j < count) {
      const __m512 scale = _mm512_set1_ps(invs[j]);
      for (int i = 0; i < V; ++i) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[j][i], scale));   // nearest even
        c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + r * k + (b0 + j) * kB + 16 * i),
                         _mm512_cvtepi32_epi8(c));
        sum = _mm512_add_epi32(sum, c);
      }
    }
    sums[j] = _mm512_castsi512_ps(sum);
  }
  const __m512i s = _mm512_castps_si512(reduce16(sums, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
  _mm512_mask_storeu_epi32(q.starts.data() + r * nb + b0, valid, _mm512_mullo_epi32(s, _mm512_set1_epi32(-128)));
  if (with_sums) _mm512_mask_storeu_ps(q.sums.data() + r * nb + b0, valid, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
}

template <class T>
Quantized quantize_rows(const T* x, int64_t rows, int64_t k, int64_t block, bool with_sums) {
  const int64_t nb = k / block;
  Quantized q{Buffer<int8_t>(rows * k), Buffer<float>(rows * nb), Buffer<int32_t>(rows * nb),
              Buffer<float>(with_sums ? rows * nb : 0)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int count = static_cast<int>(std::min<int64_t>(16, nb - b0));
        if (block == 32) quantize_blocks<2>(x, r, b0, count, k, nb, with_sums, q);
        else quantize_blocks<1>(x, r, b0, count, k, nb, with_sums, q);
      }
  });
  return q;
}

struct GemmArgs {
  const Quantized* x;
  const uint8_t* codes;    // packed, see above
  const float* scales;     // packed
  const float* offsets;    // packed or nullptr
  int64_t k, n, nb;
  float* yf;               // [M, ldy] float32 out, or
  uint16_t* yb;            // bf16 out
  int64_t ldy;             // the output's row stride
  bool stream;             // float32 out written with non-temporal stores (64-byte aligned rows)
  const float* bias32;     // [n] added to the results in float32 before any rounding, or nullptr;
  const uint16_t* bias16;  // or a bf16 bias (widened exactly), or nullptr
};

// float32 -> bf16 rounded to nearest even, as torch (NaN stays a NaN), without AVX512-BF16
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

using servelm_i8gemm::ScreenState;   // i8_screen's per-thread state (see i8_screen below)

// The bound E of 16 outputs for one row: min(row_sum x bound_max, row_max x bound_sum), each at
// least sum over blocks of bound x absmax (``i8_screen``).
inline __m512 screen_bound(const ScreenState& st, int64_t r, const __m512 (&per_output)[2]) {
  return _mm512_min_ps(_mm512_mul_ps(_mm512_set1_ps(st.row_sum[r]), per_output[0]),
                       _mm512_mul_ps(_mm512_set1_ps(st.row_max[r]), per_output[1]));
}

// The screen's epilogue of one accumulator block: each row's lower bounds raise its running largest
// one, and the outputs whose upper bound reaches it are kept (in ascending order: a thread's tiles
// ascend for every row). Padded outputs (beyond n) take part in neither.
template <int R>
void screen_tile(const __m512 (&acc)[R][kCols], const GemmArgs& a, ScreenState& st, int64_t r0, int64_t tile) {
  __mmask16 valid[kCols];
  __m512 per_output[kCols][2];
  for (int c = 0; c < kCols; ++c) {
    const int64_t n0 = tile * kTile + c * 16;
    valid[c] = n0 >= a.n ? 0 : a.n - n0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (a.n - n0)) - 1);
    per_output[c][0] = _mm512_maskz_loadu_ps(valid[c], st.bound_max + n0);
    per_output[c][1] = _mm512_maskz_loadu_ps(valid[c], st.bound_sum + n0);
  }
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    __m512 upper[kCols];
    float lower = st.lower[row];
    for (int c = 0; c < kCols; ++c) {
      const __m512 e = screen_bound(st, row, per_output[c]);
      upper[c] = _mm512_add_ps(acc[r][c], e);
      if (valid[c]) lower = std::max(lower, _mm512_mask_reduce_max_ps(valid[c], _mm512_sub_ps(acc[r][c], e)));
    }
    st.lower[row] = lower;
    for (int c = 0; c < kCols; ++c) {
      const __mmask16 hits = valid[c] & _mm512_cmp_ps_mask(upper[c], _mm512_set1_ps(lower), _CMP_GE_OQ);
      if (!hits) continue;
      auto& ids = st.ids[row];
      auto& ups = st.upper[row];
      const size_t used = ids.size();
      ids.resize(used + 16);   // a whole vector's store; trimmed to the hits below
      ups.resize(used + 16);
      const __m512i id = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(tile * kTile + c * 16)));
      _mm512_storeu_si512(ids.data() + used, _mm512_maskz_compress_epi32(hits, id));
      _mm512_storeu_ps(ups.data() + used, _mm512_maskz_compress_ps(hits, upper[c]));
      const size_t kept = used + static_cast<size_t>(__builtin_popcount(hits));
      ids.resize(kept);
      ups.resize(kept);
    }
  }
}

// Rows r0 .. r0 + R - 1 against the kTile outputs of ``tile``: stored into y, or met by the screen's
// bounds (``screen``, i8_screen).
template <int R, int B, bool kOffsets>
void micro_tile(const GemmArgs& a, int64_t r0, int64_t tile, ScreenState* screen) {
  constexpr int kSteps = B / 4;   // vpdpbusd per block and vector
  const int64_t nb = a.nb, k = a.k;
  const uint8_t* w = a.codes + tile * k * kTile;
  const float* ws = a.scales + tile * nb * kTile;
  const float* wo = kOffsets ? a.offsets + tile * nb * kTile : nullptr;
  const int8_t* xq = a.x->codes.data() + r0 * k;
  const float* xs = a.x->scales.data() + r0 * nb;
  const int32_t* xstart = a.x->starts.data() + r0 * nb;
  const float* xsum = kOffsets ? a.x->sums.data() + r0 * nb : nullptr;
  __m512 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i t[R][kCols];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(xstart[r * nb + b]);
      for (int c = 0; c < kCols; ++c) t[r][c] = start;
    }
    const uint8_t* wb = w + b * B * kTile;
    for (int s = 0; s < kSteps; ++s) {
      __m512i wv[kCols];
      for (int c = 0; c < kCols; ++c) {
        const uint8_t* p = wb + (s * kCols + c) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        wv[c] = _mm512_loadu_si512(p);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = broadcast4(xq + r * k + b * B + 4 * s);
        for (int c = 0; c < kCols; ++c) t[r][c] = _mm512_dpbusd_epi32(t[r][c], wv[c], xv);
      }
    }
    __m512 sv[kCols], ov[kCols];
    for (int c = 0; c < kCols; ++c) {
      sv[c] = _mm512_loadu_ps(ws + (b * kCols + c) * 16);
      if constexpr (kOffsets) ov[c] = _mm512_loadu_ps(wo + (b * kCols + c) * 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(xs[r * nb + b]);
      for (int c = 0; c < kCols; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), _mm512_mul_ps(sv[c], d), acc[r][c]);
        if constexpr (kOffsets) acc[r][c] = _mm512_fmadd_ps(ov[c], _mm512_set1_ps(xsum[r * nb + b]), acc[r][c]);
      }
    }
  }
  if (screen != nullptr) {
    screen_tile<R>(acc, a, *screen, r0, tile);
    return;
  }
  for (int c = 0; c < kCols; ++c) {
    const int64_t n0 = tile * kTile + c * 16;
    if (n0 >= a.n) break;
    const __mmask16 mask = a.n - n0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (a.n - n0)) - 1);
    if (a.bias32 != nullptr || a.bias16 != nullptr) {   // torch's ``out + bias`` in float32, then any rounding
      const __m512 bias = servelm_simd::load_bias16(a.bias32, a.bias16, n0, mask);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_add_ps(acc[r][c], bias);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * a.ldy + n0;
      if (a.stream && mask == 0xFFFF) _mm512_stream_ps(a.yf + at, acc[r][c]);
      else if (a.yf != nullptr) _mm512_mask_storeu_ps(a.yf + at, mask, acc[r][c]);
      else _mm256_mask_storeu_epi16(a.yb + at, mask, to_bf16(acc[r][c]));
    }
  }
}

}  // namespace

namespace {

template <int B, bool kOffsets, int R = kRows>
void dispatch_rows(int rows, const GemmArgs& a, int64_t r0, int64_t tile, ScreenState* screen) {
  if (rows == R || R == 1) {
    micro_tile<R, B, kOffsets>(a, r0, tile, screen);
  } else if constexpr (R > 1) {
    dispatch_rows<B, kOffsets, R - 1>(rows, a, r0, tile, screen);
  }
}

// Threads split the tiles. Each takes its tiles once per panel of rows (the panel's activation codes
// stay in L2 while the tiles pass), in chunks of kChunkBytes of codes that every row group of the
// panel passes over before the next chunk (from L2): each row's results are then written in runs of
// a chunk's width, not of one tile's (32 rows of LM-head logits lie 1 MiB apart: tile-wide runs fall
// into the same L1 sets and keep the write-combining buffers half full). The rows of a panel go in
// groups of at most kRows, as even as possible (9 rows: 3 + 3 + 3). With ``screen`` (i8_screen),
// each thread meets its results with the bounds in its own ScreenState (a copy of ``screen``), and
// the states go to ``states`` with the first tile of the thread's range.
template <int B, bool kOffsets>
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
        // the next chunk's codes and scales are prefetched into L2 while this one's row groups pass:
        // a slice per micro-tile call, so that the first group of the next chunk finds them there
        // instead of waiting on memory a tile at a time (several row groups only: one group reads
        // each code once, as fast as memory gives them)
        const int64_t next_tiles = std::max<int64_t>(0, std::min(end, first + 2 * chunk) - first - chunk);
        // the next chunk's first bytes (pointers formed only where it exists: the last chunk has none)
        const char* next_codes = next_tiles ? reinterpret_cast<const char*>(a.codes + (first + chunk) * a.k * kTile) : nullptr;
        const char* next_scales = next_tiles ? reinterpret_cast<const char*>(a.scales + (first + chunk) * a.nb * kTile) : nullptr;
        const int64_t code_bytes = next_tiles * a.k * kTile;
        const int64_t scale_bytes = next_tiles * a.nb * kTile * 4;
        const int64_t calls = groups * (std::min(end, first + chunk) - first);
        const int64_t slice = groups > 1 ? ((code_bytes + scale_bytes) / calls + 63) / 64 * 64 : 0;
        int64_t prefetched = 0;
        for (int64_t g = 0, r0 = p0; g < groups; ++g) {
          const int64_t group = (p0 + size - r0) / (groups - g);
          for (int64_t tile = first; tile < std::min(end, first + chunk); ++tile) {
            for (int64_t at = prefetched; at < std::min(prefetched + slice, code_bytes + scale_bytes); at += 64)
              _mm_prefetch(at < code_bytes ? next_codes + at : next_scales + (at - code_bytes), _MM_HINT_T1);
            prefetched += slice;
            dispatch_rows<B, kOffsets>(static_cast<int>(group), a, r0, tile, state);
          }
          r0 += group;
        }
      }
    }
    if (a.stream) _mm_sfence();   // the non-temporal stores are seen before the call returns
    if (state != nullptr) {
      std::lock_guard<std::mutex> lock(states_mutex);
      states->emplace_back(begin, std::move(own));
    }
  });
}


// ---------------------------------------------------------------------------------------------
// The screen's GEMM on Intel AMX tiles (``i8_screen(..., amx=True)``): the same int32 block dots and float32
// results bit for bit, so the same candidates. Per tile of 32 outputs and block of 32 inputs, the packed
// codes are already a B tile for tdpbsud (a row per 4 inputs: 16 outputs' 4 unsigned bytes; the tile's two
// vectors interleave, so a stride of two rows), read in place; each tile of 16 activation rows (the int8
// codes, padded with zero rows) is the A side (signed bytes). The tile unit's int32 sums are exact, so
// sum u q + the block's start (-128 sum q) is micro_tile's block dot, and its float32 epilogue (the
// dot times scale x d, summed over blocks in order) is micro_tile's. One tdpbsud does a block's 16 rows x
// 16 outputs (8,192 products) where vpdpbusd does 64: the work left is that epilogue. Compiled for AMX by
// function attribute; used only where ``amx_permitted`` (CPUID has AMX-TILE and AMX-INT8 and Linux
// granted the process the tile state).
namespace amx {

constexpr int64_t kRowTile = 16;

using servelm_amx::TileConfig;

bool permitted() {
  static const bool ok = servelm_amx::granted(servelm_amx::kTile | servelm_amx::kInt8);
  return ok;
}

// Tiles [begin, end) of the screen for every row (block 32, no offsets), the thread's results met by its
// ScreenState in ascending tiles, as run_gemm's threads meet theirs.
__attribute__((target("amx-tile,amx-int8"))) void screen_pass(const GemmArgs& a, const int8_t* qpad, int64_t rows,
                                                               int64_t begin, int64_t end, ScreenState& st) {
  constexpr int64_t kBlock = 32;
  const int64_t nb = a.nb, k = a.k, row_tiles = (rows + kRowTile - 1) / kRowTile;
  TileConfig cfg;   // C(i, c) = 2 i + c, A(i) = 4 + i, B(c) = 6 + c
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kRowTile;
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = kBlock, cfg.rows[t] = kRowTile;
  for (int t = 6; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kBlock / 4;
  _tile_loadconfig(&cfg);
  alignas(64) int32_t cbuf[4][kRowTile][16];
  std::vector<__m512> acc(row_tiles * kRowTile * kCols);
  const float* xs = a.x->scales.data();
  const int32_t* xstart = a.x->starts.data();
  for (int64_t tile = begin; tile < end; ++tile) {
    std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
    const uint8_t* w = a.codes + tile * k * kTile;
    const float* ws = a.scales + tile * nb * kTile;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + b * kBlock * kTile;   // 8 rows of 4 inputs x 2 vectors x 64 bytes
      for (int64_t at = 0; at < kBlock * kTile; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetchBytes + at, _MM_HINT_T0);
      _tile_loadd(6, wb, 2 * 64);
      _tile_loadd(7, wb + 64, 2 * 64);
      const __m512 sv[kCols] = {_mm512_loadu_ps(ws + b * kTile), _mm512_loadu_ps(ws + b * kTile + 16)};
      for (int64_t rt = 0; rt < row_tiles; rt += 2) {
        const bool two = rt + 1 < row_tiles;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, qpad + rt * kRowTile * k + b * kBlock, k);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
          _tile_loadd(5, qpad + (rt + 1) * kRowTile * k + b * kBlock, k);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
          _tile_stored(2, cbuf[2], 64);
          _tile_stored(3, cbuf[3], 64);
        }
        for (int i = 0; i < (two ? 2 : 1); ++i)
          for (int64_t r = 0; r < kRowTile; ++r) {
            const int64_t row = (rt + i) * kRowTile + r;
            if (row >= rows) break;
            const __m512i start = _mm512_set1_epi32(xstart[row * nb + b]);
            const __m512 d = _mm512_set1_ps(xs[row * nb + b]);
            for (int c = 0; c < kCols; ++c) {
              const __m512i t = _mm512_add_epi32(_mm512_load_si512(cbuf[2 * i + c][r]), start);
              __m512& to = acc[row * kCols + c];
              to = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sv[c], d), to);
            }
          }
      }
    }
    for (int64_t row = 0; row < rows; ++row) {
      const __m512 v[1][kCols] = {{acc[row * kCols], acc[row * kCols + 1]}};
      screen_tile<1>(v, a, st, row, tile);
    }
  }
  _tile_release();
}

void run_screen(const GemmArgs& a, int64_t rows, const ScreenState& screen,
                std::vector<std::pair<int64_t, ScreenState>>& states) {
  const int64_t tiles = (a.n + kTile - 1) / kTile;
  const int64_t padded = (rows + kRowTile - 1) / kRowTile * kRowTile;
  std::vector<int8_t> qpad(padded * a.k, 0);   // the activation codes, then zero rows to whole tiles
  std::memcpy(qpad.data(), a.x->codes.data(), rows * a.k);
  std::mutex states_mutex;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    ScreenState own = screen.fresh(rows);
    screen_pass(a, qpad.data(), rows, begin, end, own);
    std::lock_guard<std::mutex> lock(states_mutex);
    states.emplace_back(begin, std::move(own));
  });
}

}  // namespace amx
}  // namespace

// Python: i8_gemm(x, codes, scales, offsets, block, bf16_out=False, n=-1, out=None, bias=None): x [M, K]
// bfloat16 or float32; codes, scales, offsets packed as above; n outputs (-1: every packed one). Returns
// [M, n] float32 (bfloat16 when bf16_out), written into ``out`` when given (contiguous rows of that
// dtype, [M, >= n]; e.g. a reused logits buffer); ``bias`` (float32 or bfloat16 [n]) added in float32
// before the rounding to bfloat16, as ``(float32 result + bias).to(bfloat16)``.
torch::Tensor i8_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                      int64_t block, bool bf16_out, int64_t n, c10::optional<torch::Tensor> out,
                      c10::optional<torch::Tensor> bias) {
  torch::Tensor y = servelm_i8gemm::gemm_output(x, codes, scales, offsets, block, bf16_out, n, out, bias, kCols);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / block;
  const bool has_offsets = offsets.has_value() && offsets->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if (rows == 0 || n == 0) return y;
  const Quantized q = x.dtype() == torch::kFloat32
      ? quantize_rows(x.data_ptr<float>(), rows, k, block, has_offsets)
      : quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, k, block, has_offsets);
  GemmArgs a{&q, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
             has_offsets ? offsets->data_ptr<float>() : nullptr, k, n, nb,
             bf16_out ? nullptr : y.data_ptr<float>(),
             bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr, y.stride(0), false,
             has_bias && bias->dtype() == torch::kFloat32 ? bias->data_ptr<float>() : nullptr,
             has_bias && bias->dtype() == torch::kBFloat16 ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr};
  // a large float32 result (the LM head's logits: 32 MiB at 32 rows) bypasses the caches
  a.stream = a.yf != nullptr && rows * n * 4 >= kStreamBytes && n % 16 == 0 && a.ldy % 16 == 0
             && reinterpret_cast<uintptr_t>(a.yf) % 64 == 0;
  if (block == 32) {
    if (has_offsets) run_gemm<32, true>(a, rows);
    else run_gemm<32, false>(a, rows);
  } else {
    if (has_offsets) run_gemm<16, true>(a, rows);
    else run_gemm<16, false>(a, rows);
  }
  return y;
}

// Python: i8_screen(x, codes, scales, n, bound_max, bound_sum, coefficient, max_candidates, amx=False) -> [counts
// (int64 [M]), then per row its candidate ids (int64, ascending; empty where the count exceeds
// max_candidates)]: the exact greedy LM-head screen for many rows (servelm/model/gguf/lm_head_screen.py,
// ``I8Screen``), on a Q8_0 head (block 32, no offsets) packed as for i8_gemm.
//
// S[m, v] is this GEMM's result (activations rounded to int8 per block). The exact logit the caller
// compares against (gguf_kernel.cpp's int16 kernel) lies within E[m, v] of it, where
//   E <= coefficient x sum_b |scale[v, b]| (sum_i |codes[v, b, i]|) absmax[m, b]
// (the two kernels' activation roundings differ by at most absmax (1/254 + 1/65024) an input, plus
// float32 rounding: the coefficient, lm_head_screen.py ``i8_screen_coefficient``). With bound_max[v]
// and bound_sum[v] the max and the sum over blocks of |scale| sum |codes|, E is at most both
// row_sum[m] bound_max[v] and row_max[m] bound_sum[v] (row_sum, row_max: the coefficient times the
// sum and the max over blocks of absmax, = 127 d), whose minimum the screen uses. The candidates of
// row m are the outputs whose S + E reaches max over v of S - E: every other output's exact logit is
// below some candidate's. A row with a value that is not finite has none (count 0). Nothing of size
// [M, n] is stored: each thread keeps, per row, its largest lower bound so far and the outputs that
// reached it (ScreenState), filtered at the end by the largest of all. ``amx``: the GEMM on AMX tiles
// (``amx`` above: the same candidates).
std::vector<torch::Tensor> i8_screen(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t n,
                                     torch::Tensor bound_max, torch::Tensor bound_sum, double coefficient,
                                     int64_t max_candidates, bool amx) {
  TORCH_CHECK(!amx || amx::permitted(), "i8_screen: no AMX int8 tiles for this process (amx_permitted)");
  servelm_i8gemm::check_screen_args(x, codes, scales, n, bound_max, bound_sum, kCols);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / 32;
  std::vector<std::pair<int64_t, ScreenState>> states;
  if (rows == 0) return servelm_i8gemm::screen_candidates(states, 0, {}, max_candidates);
  const float* xp = x.data_ptr<float>();
  const std::vector<bool> finite = servelm_i8gemm::finite_rows(xp, rows, k);
  const Quantized q = quantize_rows(xp, rows, k, 32, false);
  std::vector<float> row_sum, row_max;
  servelm_i8gemm::screen_row_bounds(q.scales.data(), rows, nb, 127.f, static_cast<float>(coefficient), row_sum, row_max);
  GemmArgs a{&q, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, k, n, nb, nullptr, nullptr, 0, false,
             nullptr, nullptr};
  const ScreenState screen = ScreenState::over(bound_max, bound_sum, row_sum, row_max);
  if (amx) amx::run_screen(a, rows, screen, states);
  else run_gemm<32, false>(a, rows, &screen, &states);
  return servelm_i8gemm::screen_candidates(states, rows, finite, max_candidates);
}

// Python: quantize(x, block) -> (codes int8 [M, K], scales float32 [M, K / block]): the activation
// rounding i8_gemm applies, for tests and references.
std::vector<torch::Tensor> quantize(torch::Tensor x, int64_t block) {
  return servelm_i8gemm::quantized_tensors(x, block, [block](const auto* data, int64_t rows, int64_t k) {
    return quantize_rows(data, rows, k, block, false);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("i8_gemm", &i8_gemm,
        "x [M, K] (bfloat16 or float32, rounded to int8 per block) @ block-quantized W packed for vpdpbusd "
        "-> [M, n] float32 (bfloat16 when bf16_out), into out when given",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"),
        py::arg("bf16_out") = false, py::arg("n") = -1, py::arg("out") = py::none(), py::arg("bias") = py::none());
  m.def("i8_screen", &i8_screen,
        "the exact greedy screen of a Q8_0 LM head for many rows: (counts [M], then each row's candidate ids)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bound_max"), py::arg("bound_sum"),
        py::arg("coefficient"), py::arg("max_candidates"), py::arg("amx") = false);
  m.def("amx_permitted", &amx::permitted,
        "whether i8_screen(..., amx=True) runs here: AMX-TILE and AMX-INT8 (CPUID), the tile state granted by Linux");
  m.def("quantize", &quantize, "x [M, K] -> (int8 codes [M, K], float32 scales [M, K / block])",
        py::arg("x"), py::arg("block"));
  m.attr("GEMM_COLS") = kCols;
  m.attr("GEMM_ROWS") = kRows;
}
