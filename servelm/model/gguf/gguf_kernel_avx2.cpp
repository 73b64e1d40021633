// The GGUF block linear of gguf_kernel.cpp for CPUs with AVX2 + FMA but no AVX-512 (most desktops
// and laptops, AMD Zen 1-3): the same three Python functions with the same arguments and the same
// arithmetic, y[M, N] = x[M, K] @ W.T with W[n, k] = codes[n, k] * scales[n, k / B] (+ offsets[n, k / B]),
// B = 16 or 32 (gguf_blocks.py), read from the int8 codes as they are stored (1 byte per weight).
// Scales and offsets come as float32 [N, K / B], or compact (``BlockValues``: fp16, or int8 sub-scales
// times a float32 per 256 inputs), widened per weight row to the same float32 values.
//
// Activation formats, as gguf_kernel.cpp's:
//   block_linear_a16  q = round(x / d) in [-32512, 32512], d = amax / 32512 per 32 inputs (the default)
//   block_linear      q = round(x / d) in [-127, 127],     d = amax / 127   per 32 inputs (llama.cpp's)
//   block_linear_float  x unrounded, the codes converted to float and scaled in registers (from 12 rows
//                       into a tile of weight rows first: BlockGemm::float_tiles).
// Both rounded formats keep q as int16 and multiply it by the codes sign-extended to int16 with
// vpmaddwd (pairs of int16 products summed into int32): |q| <= 32512 and |code| <= 128, so a pair is
// at most 2 * 32512 * 128 < 2^23 and a block's int32 lane sums (2 or 4 pairs) are exact -- no
// saturation case at all, unlike vpmaddubsw (unsigned x signed bytes into int16), whose pairs
// overflow for the 16-bit format's low byte (2 * 255 * 128 > 32767) on Q8_0's codes. The int32 sums
// of a block are then scaled in float32 (weight scale x activation scale), as the VNNI kernel does.
//
// Compiled by servelm/model/gguf/gguf_kernel.py with -mavx2 -mfma -mf16c where /proc/cpuinfo has
// them; gguf_kernel.load_kernel picks the AVX-512 build where the CPU has AVX512-VNNI.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <memory>
#include <vector>
#include <unistd.h>

#include "servelm_activation.h"
#include "servelm_row_attention.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int kActBlock = 32;        // activation quantization block
constexpr int kRowTile = 8;          // activation rows sharing one pass over a weight row
constexpr int64_t kWeightTile = 32;  // weight rows kept hot in L2 while all activation rows pass
constexpr int64_t kMinChunkBytes = 32768;  // the least weight bytes worth a thread of their own
constexpr int64_t kPrefetchBytes = 4096;   // how far ahead of a weight row's block the stream is prefetched
constexpr int kOneRowWeights = 4;          // weight rows per pass of one activation row (decode)
constexpr int64_t kScaleAheadRows = 16;    // how far ahead of the one-row pass its scale rows are prefetched

// Per-thread buffers reused from call to call (``slot`` tells apart the buffers of one call; float
// slots 0-2 and 5 belong to the calling thread's activations, 3-4 to a worker's widened scale rows, 6-7 to
// a worker's dequantized weight tile and its dots: BlockGemm::float_tiles).
template <class T>
T* scratch(int slot, int64_t count) {
  static thread_local std::vector<T> buffers[8];
  std::vector<T>& buffer = buffers[slot];
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [hsum(v), hsum(w), hsum(y), hsum(z)] bit for bit (the same additions in the same order, four at a time)
inline __m128 hsum4(__m256 v, __m256 w, __m256 y, __m256 z) {
  // lanes 0-3: v's low half + its high half, 4-7: w's (as hsum's first add); then y and z
  const __m256 vw = _mm256_add_ps(_mm256_permute2f128_ps(v, w, 0x20), _mm256_permute2f128_ps(v, w, 0x31));
  const __m256 yz = _mm256_add_ps(_mm256_permute2f128_ps(y, z, 0x20), _mm256_permute2f128_ps(y, z, 0x31));
  // per 128-bit half [s0 + s2, s1 + s3] of each (hsum's movehl add), then their sum (its movehdup add)
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(vw, yz, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(vw, yz, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));   // [v, y, ..] [w, z, ..]
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
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

// x [rows, k] as float32: bf16 widened exactly into a scratch buffer, float32 used in place.
const float* float_rows(const torch::Tensor& x, int64_t count) {
  if (x.dtype() == torch::kFloat32) return x.data_ptr<float>();
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  float* out = scratch<float>(0, count);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
  }
  for (; i < count; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(out + i, &word, sizeof(word));
  }
  return out;
}

// A contiguous byte range prefetched as it is read: every cache line once, ``ahead`` bytes in front
// of the reader (the one-row pass's NW rows). A prefetch only where a step's offset within its row
// starts a cache line's worth (what the pass did before) misses lines wherever the rows do not start
// on a cache line (5 bits: 20-byte steps, rows of 560 bytes at K = 896: ~1 line in 10, which the
// hardware prefetcher does not catch either): each a DRAM round trip inside the pass, ~1.4x slower
// cold one-row calls (gate_up 9728x896, 1 thread). A prefetch per row and step instead (4 per step)
// measured ~1.3x slower than this stream (a standalone loop, cold, 1 thread).
class LineStream {
 public:
  LineStream(const uint8_t* begin, int64_t ahead)
      : start_(reinterpret_cast<uintptr_t>(begin) + ahead), line_(start_ & ~uintptr_t{63}) {}
  // The reader is about to read the range's first ``bytes`` bytes: the lines ``ahead`` of them fetched.
  void upto(int64_t bytes) {
    for (const uintptr_t end = start_ + bytes; line_ < end; line_ += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line_), _MM_HINT_T0);
  }

 private:
  uintptr_t start_;
  uintptr_t line_;
};

// 16 int8 codes sign-extended to int16
inline __m256i load_codes16(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// Where a weight row's codes come from, 32 at a time (step c: inputs 32c .. 32c + 31), as two
// vectors of 16 codes sign-extended to int16 (w0: the first 16, w1: the next 16).
//
// ByteCodes: the int8 codes as stored (1 byte per weight).
//
// ``load_stored`` gives the stored values u and ``kBias`` what they exceed the codes by (``load``:
// u - kBias, the codes): the one-row pass subtracts kBias times the activations' sums from the int32
// products instead (``IntActivations::bias_correction``), once per row and 32 inputs, not per code.
struct ByteCodes {
  static constexpr int64_t kStepBytes = 32;
  static constexpr int kBias = 0;
  static void load_stored(const uint8_t* row, int64_t c, __m256i& w0, __m256i& w1) {
    const int8_t* w = reinterpret_cast<const int8_t*>(row) + c * 32;
    w0 = load_codes16(w);
    w1 = load_codes16(w + 16);
  }
  static void load(const uint8_t* row, int64_t c, __m256i& w0, __m256i& w1) { load_stored(row, c, w0, w1); }
};

// PackedCodes<BITS, CENTERED>: the codes at their own bit width (4, 5 or 6; gguf_blocks.PackedCodes
// writes them), 4 * BITS bytes per 32 inputs: 16 bytes of nibbles (byte j: the low 4 bits of code j
// in its low nibble, of code j + 16 in its high one), then for BITS = 5 and 6 a plane of the codes'
// high bits (4 or 8 bytes, read as one little-endian integer P) laid out for 16-bit lanes: with
// i' = i % 16 and h = i / 16 (which vector of 16 codes), bit 4 of code i is P's bit
// 16 (i' % 2) + 8 h + i' / 2 (5 bits), bits 4-5 of code i are P's bits from 16 (i' % 4) + 8 h + 2 (i' / 4)
// (6 bits): one variable shift of P per 32- or 64-bit lane brings every code's high bits to bit 0
// (first 16 codes) and bit 8 (next 16) of its own 16-bit lane. The stored value u is the code
// (CENTERED false: codes 0 .. 2^BITS - 1) or code + 2^(BITS - 1) (CENTERED: signed codes). Lossless:
// the same int16 codes as ByteCodes gives, so the same products.
template <int BITS, bool CENTERED>
struct PackedCodes {
  static_assert(BITS >= 4 && BITS <= 6, "4, 5 or 6 bits");
  static constexpr int64_t kStepBytes = 4 * BITS;
  static constexpr int kBias = CENTERED ? 1 << (BITS - 1) : 0;
  static void load_stored(const uint8_t* row, int64_t c, __m256i& w0, __m256i& w1) {
    const uint8_t* p = row + c * kStepBytes;
    // 16-bit lane j: code j | code j + 16 << 4
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (BITS == 4) {
      w0 = _mm256_and_si256(words, _mm256_set1_epi16(0x0F));
      w1 = _mm256_srli_epi16(words, 4);
    } else {
      constexpr int kMask = BITS == 5 ? 1 : 3;
      __m256i high;   // lane j: code j's high bits at bit 0, code j + 16's at bit 8
      if constexpr (BITS == 5) {
        int32_t plane;
        std::memcpy(&plane, p + 16, sizeof(plane));
        high = _mm256_srlv_epi32(_mm256_set1_epi32(plane), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      } else {
        int64_t plane;
        std::memcpy(&plane, p + 16, sizeof(plane));
        high = _mm256_srlv_epi64(_mm256_set1_epi64x(plane), _mm256_setr_epi64x(0, 2, 4, 6));
      }
      w0 = _mm256_or_si256(_mm256_and_si256(words, _mm256_set1_epi16(0x0F)),
                           _mm256_and_si256(_mm256_slli_epi16(high, 4), _mm256_set1_epi16(kMask << 4)));
      // code j + 16's high bits set at bits 8-9, above the byte, then shifted down with its nibble
      w1 = _mm256_srli_epi16(_mm256_or_si256(words, _mm256_and_si256(high, _mm256_set1_epi16(kMask << 8))), 4);
    }
  }
  static void load(const uint8_t* row, int64_t c, __m256i& w0, __m256i& w1) {
    load_stored(row, c, w0, w1);
    if constexpr (CENTERED) {
      w0 = _mm256_sub_epi16(w0, _mm256_set1_epi16(kBias));
      w1 = _mm256_sub_epi16(w1, _mm256_set1_epi16(kBias));
    }
  }
};

// Rounded activations (both integer formats): q = round(x / d) per row and kActBlock inputs with
// d = amax / qmax, and d per block. The arithmetic is the VNNI kernel's (d, 1 / d or 0, round to
// nearest even of x * (1 / d)), so q is the same integer. A few rows (decode) are quantized by the
// calling thread: a parallel region costs more than they do.
// Layout: by row tiles (kRowTile rows from r0, a multiple of kRowTile; the last tile may have fewer),
// each tile's blocks interleaved: q of row r0 + t, block c at codes + r0 * k + (c * tile + t) * 32, its d
// at block_scales + r0 * (k / 32) + c * tile + t (tile: the tile's rows). A tile's pass then reads all
// its rows' step from one pointer at constant offsets (8 rows' own pointers spilled from the 15
// general registers). A tile of one row (a lone or last row) is plain row-major.
struct IntActivations {
  static constexpr int64_t kKMultiple = kActBlock;
  const int16_t* codes;
  const float* block_scales;
  int64_t k;

  IntActivations(const float* x, int64_t rows, int64_t k_, float qmax) : k(k_) {
    int16_t* q = scratch<int16_t>(0, rows * k);
    float* scales = scratch<float>(1, rows * (k / kActBlock));
    const __m256 sign = _mm256_set1_ps(-0.f);
    const int64_t nb = k / kActBlock;
    auto quantize = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t r0 = r / kRowTile * kRowTile, t = r - r0;
        const int64_t tile = std::min<int64_t>(kRowTile, rows - r0);
        for (int64_t b = 0; b < nb; ++b) {
          const float* xb = x + r * k + b * kActBlock;
          __m256 v[4];
          __m256 amax = _mm256_setzero_ps();
          for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
          }
          const float d = hmax(amax) / qmax;
          const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
          int16_t* qb = q + r0 * k + (b * tile + t) * kActBlock;
          for (int half = 0; half < 2; ++half) {
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half], inv));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half + 1], inv));
            // packs works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder the 64-bit quarters
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16 * half), packed);
          }
          scales[r0 * nb + b * tile + t] = d;
        }
      }
    };
    if (rows <= kRowTile) {
      quantize(0, rows);
    } else {
      at::parallel_for(0, rows, 1, quantize);
    }
    codes = q;
    block_scales = scales;
  }

  // The tile of ROWS activation rows from r0 (all its rows) against one weight row; per 32 inputs: two
  // vpmaddwd of 16 codes each, their int32 lanes (B = 32: added; B = 16: each its own block) scaled
  // into a float accumulator per row.
  template <int ROWS, class Codes>
  void dot(const uint8_t* w, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const int16_t* tile_q = codes + r0 * k;
    const float* tile_s = block_scales + r0 * (k / kActBlock);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t steps = k / kActBlock;
    for (int64_t c = 0; c < steps; ++c) {
      const int16_t* xq = tile_q + c * ROWS * 32;   // row r's 32 codes at xq + 32 r
      const float* xs = tile_s + c * ROWS;           // and their d at xs[r]
      // every step (16-32 bytes: each cache line at least once, wherever the row starts); a LineStream
      // here measured 4-9% slower for 2-4 rows (gate_up, 1 thread, cold), this 5-7% faster than
      // prefetching only on the steps whose offset in the row starts a cache line's worth
      _mm_prefetch(reinterpret_cast<const char*>(w + c * Codes::kStepBytes) + kPrefetchBytes, _MM_HINT_T0);
      __m256i w0, w1;
      Codes::load(w, c, w0, w1);
      if (block == 32) {
        const float ws = w_scales[c];
        for (int r = 0; r < ROWS; ++r) {
          const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * r)));
          const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * r + 16)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(ws * xs[r]), acc[r]);
        }
      } else {
        const float ws0 = w_scales[2 * c], ws1 = w_scales[2 * c + 1];
        for (int r = 0; r < ROWS; ++r) {
          const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * r)));
          const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * r + 16)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(ws0 * xs[r]), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(ws1 * xs[r]), acc[r]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
  }

  // kBias x the sums of activation row r0's inputs that each int32 lane of the one-row pass's products
  // covers [k / 32, 8] (block 32: lane l of step c covers inputs 32c + 2l, 2l + 1, 16 + 2l, 17 + 2l):
  // madd(u, x) - correction is madd(u - kBias, x) exactly (int32, |values| < 2^24), so the products are
  // those of the codes themselves. Block 16 (two sums per lane and step) subtracts kBias from the codes.
  const int32_t* bias_correction(int bias, int64_t r0) const {
    const int64_t steps = k / kActBlock;
    int32_t* out = scratch<int32_t>(0, steps * 8);
    const __m256i b = _mm256_set1_epi16(static_cast<int16_t>(bias));
    const int16_t* xq = codes + r0 * k;
    for (int64_t c = 0; c < steps; ++c) {
      const __m256i s0 = _mm256_madd_epi16(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32)));
      const __m256i s1 = _mm256_madd_epi16(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32 + 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * 8), _mm256_add_epi32(s0, s1));
    }
    return out;
  }

  // One activation row (r0) against NW weight rows (w, w + row_bytes, ...): NW independent
  // accumulator chains sharing the activation loads; each row's arithmetic and order exactly dot<1>'s.
  // ``scaled`` [NW, nb]: each row's weight scales times the activation scale of their inputs (the same
  // float32 products dot<1> forms per step); ``correction``: bias_correction's for Codes::kBias (block 32).
  template <int NW, class Codes>
  void dot_rows(const uint8_t* w, int64_t row_bytes, const float* scaled, int64_t nb, const int32_t* correction,
                int64_t block, int64_t r0, float* out) const {
    const int16_t* xq = codes + r0 * k;
    __m256 acc[NW];
    for (int r = 0; r < NW; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t steps = k / kActBlock;
    // The pass reads its rows' NW * row_bytes contiguous bytes, prefetched as one stream at least a
    // pass ahead (kPrefetchBytes alone would land in this pass's own rows wherever rows are long:
    // K = 4864, 3.6 KB) at the pace of the steps: NW * kStepBytes more per step.
    LineStream stream(w, std::max<int64_t>(kPrefetchBytes, NW * row_bytes));
    auto prefetch = [&](int64_t c) { stream.upto((c + 1) * NW * Codes::kStepBytes); };
    if (block == 32) {
      for (int64_t c = 0; c < steps; ++c) {
        prefetch(c);
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32 + 16));
        for (int r = 0; r < NW; ++r) {
          __m256i w0, w1;
          Codes::load_stored(w + r * row_bytes, c, w0, w1);
          __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
          if constexpr (Codes::kBias != 0)
            p = _mm256_sub_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction + c * 8)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(scaled + r * nb + c), acc[r]);
        }
      }
    } else {
      for (int64_t c = 0; c < steps; ++c) {
        prefetch(c);
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 32 + 16));
        for (int r = 0; r < NW; ++r) {
          // the codes themselves (stored values minus kBias in int16: two subtractions either way, and
          // no [k / 32, 16] correction table sharing the L1 with the rows' stream)
          __m256i w0, w1;
          Codes::load(w + r * row_bytes, c, w0, w1);
          const __m256i p0 = _mm256_madd_epi16(w0, x0), p1 = _mm256_madd_epi16(w1, x1);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(scaled + r * nb + 2 * c), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(scaled + r * nb + 2 * c + 1), acc[r]);
        }
      }
    }
    for (int r = 0; r < NW; ++r) out[r] = hsum(acc[r]);
  }
};

struct Int16Activations : IntActivations {
  Int16Activations(const float* x, int64_t rows, int64_t k) : IntActivations(x, rows, k, 32512.f) {}
};

struct Int8Activations : IntActivations {
  Int8Activations(const float* x, int64_t rows, int64_t k) : IntActivations(x, rows, k, 127.f) {}
};

// Step c (inputs 32c .. 32c + 31) of a weight row as float32 code * scale, 8 inputs a vector: exactly the
// float32 dequantized weight. The int8 codes widen straight from memory; packed ones through Codes::load.
template <class Codes>
inline void dequantize_step(const uint8_t* row, const float* scales, int64_t block, int64_t c, __m256 wf[4]) {
  const __m256 s0 = _mm256_set1_ps(block == 32 ? scales[c] : scales[2 * c]);
  const __m256 s1 = _mm256_set1_ps(block == 32 ? scales[c] : scales[2 * c + 1]);
  if constexpr (std::is_same<Codes, ByteCodes>::value) {
    const int8_t* w = reinterpret_cast<const int8_t*>(row) + c * 32;
    for (int i = 0; i < 4; ++i) {
      const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * i)));
      wf[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), i < 2 ? s0 : s1);
    }
  } else {
    __m256i w16[2];
    Codes::load(row, c, w16[0], w16[1]);
    for (int i = 0; i < 4; ++i) {
      const __m128i half = i % 2 == 0 ? _mm256_castsi256_si128(w16[i / 2]) : _mm256_extracti128_si256(w16[i / 2], 1);
      wf[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half)), i < 2 ? s0 : s1);
    }
  }
}

// Float activations, unrounded: the weight row dequantized in registers (code * scale, exactly the
// float32 dequantized weight) and multiplied by x; only the summation order differs from F.linear.
struct FloatActivations {
  static constexpr int64_t kKMultiple = 32;
  const float* x;
  int64_t k;

  FloatActivations(const float* x_, int64_t /*rows*/, int64_t k_) : x(x_), k(k_) {}

  template <int ROWS, class Codes>
  void dot(const uint8_t* w_bytes, const float* w_scales, int64_t block, int64_t r0, float* out) const {
    const float* xr[ROWS];
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      xr[r] = x + (r0 + r) * k;
      acc[r] = _mm256_setzero_ps();
    }
    const int64_t steps = k / 32;
    for (int64_t c = 0; c < steps; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w_bytes + c * Codes::kStepBytes) + kPrefetchBytes, _MM_HINT_T0);
      __m256 wf[4];
      dequantize_step<Codes>(w_bytes, w_scales, block, c, wf);
      for (int r = 0; r < ROWS; ++r)
        for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(wf[i], _mm256_loadu_ps(xr[r] + c * 32 + 8 * i), acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
  }
};

// ---- Float activations on many rows: the weight dequantized once per tile, then register-blocked ----
//
// FloatActivations::dot dequantizes a weight row in registers for each tile of kRowTile activation rows:
// at 32 rows 4 times, and its 8 accumulators take a load of x for every FMA. From kFloatTileRows rows on,
// a worker dequantizes float_tile_bytes() of weight rows at a time into a float32 buffer (the same
// float(code) * scale products), then runs a kFloatMR x kFloatNR block of (activation row, weight row)
// dots per pass: 3 weight and 4 activation vectors loaded per 12 FMAs. Each dot keeps FloatActivations::dot's
// arithmetic exactly -- lane l of one accumulator sums the products of inputs l, l + 8, ... in order, then
// hsum, then the offsets' and bias terms as ``finish`` adds them -- so the results are the same floats on
// any row count, tile or thread split, and the same as the row tiles' below kFloatTileRows rows (for
// int8 and packed codes alike: dequantize_step).
constexpr int kFloatMR = 4;                   // activation rows per pass
constexpr int kFloatNR = 3;                   // weight rows per pass
constexpr int64_t kFloatTileRows = 12;        // the least rows that take the tiles (fewer: the row tiles)

// Bytes of dequantized weight rows per tile: a quarter of this CPU's L2 (sysconf; 512 KiB where it does not
// say), within 64 KiB .. 512 KiB. On Zen 3 (512 KiB L2) a quarter ran Qwen2.5-Coder's shapes at 16-128 rows
// 2-10% faster than an eighth or a half (benchmarks/gguf_avx2.py, RESULTS.md session 40).
int64_t float_tile_bytes() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return std::clamp<int64_t>((l2 > 0 ? l2 : 512 << 10) / 4, 64 << 10, 512 << 10);
}

template <int MR, int NR>
inline void float_block(const float* x, int64_t k, const float* w, float* dots) {
  __m256 a[kFloatMR][NR];
  for (int t = 0; t < kFloatMR; ++t)
    for (int j = 0; j < NR; ++j) a[t][j] = _mm256_setzero_ps();
  for (int64_t v = 0; v < k / 8; ++v) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * k + 8 * v);
    for (int t = 0; t < MR; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * k + 8 * v);
      for (int j = 0; j < NR; ++j) a[t][j] = _mm256_fmadd_ps(wv[j], xv, a[t][j]);
    }
  }
  // dots[j * kFloatMR + t]: the dot of activation row t and weight row j (rows past MR: zeros, unread)
  for (int j = 0; j < NR; ++j) _mm_storeu_ps(dots + j * kFloatMR, hsum4(a[0][j], a[1][j], a[2][j], a[3][j]));
}

template <int MR>
inline void float_block_rows(int nr, const float* x, int64_t k, const float* w, float* dots) {
  switch (nr) {
    case 3: float_block<MR, 3>(x, k, w, dots); break;
    case 2: float_block<MR, 2>(x, k, w, dots); break;
    default: float_block<MR, 1>(x, k, w, dots); break;
  }
}

// float_block for the mr x nr corner a tile's edge leaves (mr <= kFloatMR, nr <= kFloatNR)
inline void float_block_any(int mr, int nr, const float* x, int64_t k, const float* w, float* dots) {
  switch (mr) {
    case 4: float_block_rows<4>(nr, x, k, w, dots); break;
    case 3: float_block_rows<3>(nr, x, k, w, dots); break;
    case 2: float_block_rows<2>(nr, x, k, w, dots); break;
    default: float_block_rows<1>(nr, x, k, w, dots); break;
  }
}

// ROWS = tile activation rows (1-kRowTile) against one weight row.
template <class Codes, class Activations>
inline void dot_tile(const Activations& acts, const uint8_t* wr, const float* sr, int64_t block, int64_t r0, int tile,
                     float* dots) {
  switch (tile) {
    case 8: acts.template dot<8, Codes>(wr, sr, block, r0, dots); break;
    case 7: acts.template dot<7, Codes>(wr, sr, block, r0, dots); break;
    case 6: acts.template dot<6, Codes>(wr, sr, block, r0, dots); break;
    case 5: acts.template dot<5, Codes>(wr, sr, block, r0, dots); break;
    case 4: acts.template dot<4, Codes>(wr, sr, block, r0, dots); break;
    case 3: acts.template dot<3, Codes>(wr, sr, block, r0, dots); break;
    case 2: acts.template dot<2, Codes>(wr, sr, block, r0, dots); break;
    default: acts.template dot<1, Codes>(wr, sr, block, r0, dots); break;
  }
}

// Weight rows n0 .. n1 - 1 of packed codes as int8 codes [n1 - n0, k] in a per-thread buffer.
template <class Codes>
const int8_t* unpack_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k) {
  int8_t* out = scratch<int8_t>(0, (n1 - n0) * k);
  for (int64_t j = n0; j < n1; ++j)
    for (int64_t c = 0; c < k / 32; ++c) {
      __m256i w0, w1;
      Codes::load(w + j * row_bytes, c, w0, w1);
      // packs interleaves per 128-bit lane: [w0 0-7, w1 0-7, w0 8-15, w1 8-15] -> reorder the quarters
      const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(w0, w1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (j - n0) * k + c * 32), bytes);
    }
  return out;
}

// A weight's scales (or offsets) [N, K / B], in one of three layouts, read a row at a time as the
// float32 values gguf_blocks.BlockWeight holds (bit for bit: gguf_blocks.CompactValues checks each
// layout against them before handing it here):
//   float32 [N, nb]                   the values themselves;
//   float16 [N, nb]                   types whose scale (offset) is a stored fp16 d (m): Q8_0, Q4_0,
//                                     Q5_0, Q4_1, Q5_1; widened exactly by F16C;
//   int8 [N, nb + 4 * K / 256]        the K-quants: per row nb int8 sub-scales (6-bit sc, m; Q6_K's
//                                     signed sc), then one float32 multiplier per 256 inputs (d, or
//                                     -dmin for offsets) as little-endian bytes; value = sub * multiplier,
//                                     an exact float32 product (|sub| < 2^7 times an fp16 value).
// The compact layouts read 2 or ~1.1 bytes per block instead of 4 (Q4_K: 0.19 bytes per weight of
// scales and offsets in float32, 0.06 compact).
struct BlockValues {
  enum Layout { kFloat32, kFloat16, kSubScaled };
  Layout layout = kFloat32;
  const uint8_t* base = nullptr;
  int64_t row_bytes = 0;   // bytes per weight row
  int64_t nb = 0;          // values per row: K / B
  int64_t per_super = 0;   // kSubScaled: blocks per 256 inputs (8 or 16)
  int super_shift = 0;     // kSubScaled: log2(per_super)

  BlockValues() = default;
  BlockValues(const torch::Tensor& t, int64_t n, int64_t k, int64_t block, const char* what) : nb(k / block) {
    TORCH_CHECK(t.is_contiguous() && t.dim() == 2 && t.size(0) == n, what, ": contiguous [N, ...]");
    base = static_cast<const uint8_t*>(t.data_ptr());
    if (t.dtype() == torch::kFloat32) {
      TORCH_CHECK(t.size(1) == nb, what, ": float32 [N, K / block]");
      layout = kFloat32;
      row_bytes = 4 * nb;
    } else if (t.dtype() == torch::kFloat16) {
      TORCH_CHECK(t.size(1) == nb, what, ": float16 [N, K / block]");
      layout = kFloat16;
      row_bytes = 2 * nb;
    } else {
      TORCH_CHECK(t.dtype() == torch::kInt8 && k % 256 == 0 && t.size(1) == nb + 4 * (k / 256), what,
                  ": float32 or float16 [N, K / block], or int8 [N, K / block + 4 * K / 256] (K a multiple of 256)");
      layout = kSubScaled;
      row_bytes = nb + 4 * (k / 256);
      per_super = 256 / block;
      super_shift = block == 32 ? 3 : 4;
    }
  }

  // Row j as float32 [nb]: in place (float32) or widened into ``buffer`` (nb floats). With ``times``
  // [nb]: value b times times[b] into ``buffer`` (each the float32 product value * times[b]).
  const float* row(int64_t j, float* buffer, const float* times = nullptr) const {
    const uint8_t* r = base + j * row_bytes;
    if (layout == kFloat32 && times == nullptr) return reinterpret_cast<const float*>(r);
    auto scaled = [&](int64_t b, __m256 v) { return times == nullptr ? v : _mm256_mul_ps(v, _mm256_loadu_ps(times + b)); };
    if (layout == kFloat32) {
      const float* f = reinterpret_cast<const float*>(r);
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(buffer + b, scaled(b, _mm256_loadu_ps(f + b)));
      for (; b < nb; ++b) buffer[b] = f[b] * times[b];
      return buffer;
    }
    if (layout == kFloat16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(r);
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(buffer + b, scaled(b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + b)))));
      if (b + 4 <= nb) {   // K = 896: 28 blocks, 3 x 8 + 4
        const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + b)));
        _mm_storeu_ps(buffer + b, times == nullptr ? v : _mm_mul_ps(v, _mm_loadu_ps(times + b)));
        b += 4;
      }
      for (; b < nb; ++b) buffer[b] = times == nullptr ? _cvtsh_ss(h[b]) : _cvtsh_ss(h[b]) * times[b];
      return buffer;
    }
    const int8_t* sub = reinterpret_cast<const int8_t*>(r);
    const uint8_t* multipliers = r + nb;
    // nb and per_super (8 or 16) are multiples of 8: one multiplier per 8 values, at b >> super_shift
    // (b / per_super was a 64-bit division per 8 values: with the rest of the widening of the scale and
    // offset rows, ~30% of a hot Q4_K one-row call)
    for (int64_t b = 0; b < nb; b += 8) {
      float m;
      std::memcpy(&m, multipliers + 4 * (b >> super_shift), sizeof(m));
      const __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + b))));
      _mm256_storeu_ps(buffer + b, scaled(b, _mm256_mul_ps(wide, _mm256_set1_ps(m))));
    }
    return buffer;
  }

  // Rows j0 .. j1 - 1 (those below ``n``) fetched into the caches ahead of their use: the codes are
  // prefetched, and a scale row read cold stalls the pass that widens it (~20% of a cold one-row call).
  void prefetch_rows(int64_t j0, int64_t j1, int64_t n) const {
    if (base == nullptr || j0 >= n) return;
    const uintptr_t first = reinterpret_cast<uintptr_t>(base + j0 * row_bytes) & ~uintptr_t{63};
    const uintptr_t last = reinterpret_cast<uintptr_t>(base + std::min(j1, n) * row_bytes);
    for (uintptr_t line = first; line < last; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
};

// A weight's rows split over threads: ``rows(begin, end)`` computes outputs begin .. end - 1 (any split:
// each output is one thread's, with the same arithmetic wherever the split falls).
struct RowRange {
  virtual ~RowRange() = default;
  virtual void rows(int64_t begin, int64_t end) const = 0;
  int64_t n = 0;       // outputs (weight rows)
  int64_t grain = 1;   // the least outputs worth a thread of their own
};

// y = x @ W.T for one activation format once x is prepared (the constructor, on the calling thread:
// the activations rounded, the one-row pass's scales): tiling (kWeightTile weight rows x kRowTile
// activation rows per pass) over the weight rows a thread is given (``rows``) and the offsets term.
// ``Codes``: where the weight rows' codes come from (ByteCodes or PackedCodes). ``y`` (float32) or
// ``y16`` (bf16) [rows, n]: the output.
template <class Activations, class Codes>
struct BlockGemm final : RowRange {
  static constexpr bool kBytes = std::is_same<Codes, ByteCodes>::value;
  static constexpr bool kIntActivations = std::is_base_of<IntActivations, Activations>::value;
  int64_t num_rows, k, row_bytes, nb, block;
  const Activations acts;
  const float* sums;
  const uint8_t* w;
  const BlockValues& weight_scales;
  const BlockValues& weight_offsets;
  bool has_offsets;
  const float* bias32;
  const c10::BFloat16* bias16;
  float* y;
  c10::BFloat16* y16;
  int64_t one_row;   // the only row a tile of one can start at
  bool has_one_row_pass;
  const float* xs_blocks = nullptr;
  const int32_t* correction = nullptr;

  BlockGemm(const float* xp, int64_t rows_, int64_t k_, int64_t n_, const uint8_t* w_, const BlockValues& scales,
            const BlockValues& offsets, bool has_offsets_, int64_t block_, const float* bias32_,
            const c10::BFloat16* bias16_, float* y_, c10::BFloat16* y16_)
      : num_rows(rows_), k(k_), row_bytes(k_ / 32 * Codes::kStepBytes), nb(k_ / block_), block(block_),
        acts(xp, rows_, k_), sums(has_offsets_ ? block_sums(xp, rows_, k_, block_) : nullptr), w(w_),
        weight_scales(scales), weight_offsets(offsets), has_offsets(has_offsets_), bias32(bias32_), bias16(bias16_),
        y(y_), y16(y16_), one_row(rows_ - 1),
        has_one_row_pass(kIntActivations && rows_ % kRowTile == 1 && (kBytes || rows_ <= kRowTile)) {
    n = n_;
    grain = std::max<int64_t>(16, kMinChunkBytes / std::max<int64_t>(row_bytes, 1));
    // The one-row pass (a last row tile of one row read from the codes as stored: decode) scales each
    // weight row by the activation scales of its blocks once (xs_blocks [nb]), and takes stored values
    // minus a correction where the codes are stored biased (Codes::kBias; ``correction``).
    if constexpr (kIntActivations) {
      if (has_one_row_pass) {
        const float* xs = acts.block_scales + one_row * (k / kActBlock);
        if (block == 32) {
          xs_blocks = xs;
        } else {
          float* twice = scratch<float>(5, nb);
          for (int64_t b = 0; b < nb; ++b) twice[b] = xs[b / 2];
          xs_blocks = twice;
        }
        if (Codes::kBias != 0 && block == 32) correction = acts.bias_correction(Codes::kBias, one_row);
      }
    }
  }

  // Output j of activation row ``row`` from its dot: the offsets' term (``orow``: the weight row's
  // offsets, or null), the bias, then the float32 or bf16 (round to nearest even, as torch) store.
  void store(int64_t j, int64_t row, float value, const float* orow) const {
    if (orow != nullptr) value += dot_f32(orow, sums + row * nb, nb);
    if (bias32 != nullptr) value += bias32[j];
    if (bias16 != nullptr) value += static_cast<float>(bias16[j]);
    if (y16 != nullptr) {
      y16[row * n + j] = c10::BFloat16(value);
    } else {
      y[row * n + j] = value;
    }
  }

  // Float activations from kFloatTileRows rows: weight rows dequantized a tile at a time, then
  // kFloatMR x kFloatNR blocks (float_block).
  void float_tiles(int64_t begin, int64_t end) const {
    const float* x = acts.x;
    static const int64_t tile_bytes = float_tile_bytes();
    const int64_t tile_rows = std::max<int64_t>(kFloatNR, tile_bytes / (4 * k) / kFloatNR * kFloatNR);
    float* wt = scratch<float>(6, tile_rows * k);
    float* dots = scratch<float>(7, tile_rows * kFloatMR);
    float* scale_row = scratch<float>(3, nb);
    float* offset_row = scratch<float>(4, nb);
    for (int64_t n0 = begin; n0 < end; n0 += tile_rows) {
      const int64_t n1 = std::min(end, n0 + tile_rows);
      for (int64_t j = n0; j < n1; ++j) {   // FloatActivations::dot's weights
        const float* sr = weight_scales.row(j, scale_row);
        float* out = wt + (j - n0) * k;
        for (int64_t c = 0; c < k / 32; ++c) {
          __m256 wf[4];
          dequantize_step<Codes>(w + j * row_bytes, sr, block, c, wf);
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + c * 32 + 8 * i, wf[i]);
        }
      }
      for (int64_t r0 = 0; r0 < num_rows; r0 += kFloatMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kFloatMR, num_rows - r0));
        for (int64_t j = n0; j < n1; j += kFloatNR)
          float_block_any(mr, static_cast<int>(std::min<int64_t>(kFloatNR, n1 - j)), x + r0 * k, k, wt + (j - n0) * k,
                          dots + (j - n0) * kFloatMR);
        for (int64_t j = n0; j < n1; ++j) {
          const float* orow = has_offsets ? weight_offsets.row(j, offset_row) : nullptr;
          for (int t = 0; t < mr; ++t) store(j, r0 + t, dots[(j - n0) * kFloatMR + t], orow);
        }
      }
    }
  }

  void rows(int64_t begin, int64_t end) const override {
    if constexpr (std::is_same<Activations, FloatActivations>::value) {
      if (num_rows >= kFloatTileRows) {
        float_tiles(begin, end);
        return;
      }
    }
    row_tiles(begin, end);
  }

  // kRowTile activation rows at a time against each weight row (dot_tile), the one-row pass for a lone row
  void row_tiles(int64_t begin, int64_t end) const {
    const int64_t rows = num_rows;
    float dots[kRowTile];
    // this worker's widened scale rows (kOneRowWeights for the one-row pass) and offset row (one at a time)
    float* scale_rows = scratch<float>(3, kOneRowWeights * nb);
    float* offset_rows = scratch<float>(4, nb);
    for (int64_t n0 = begin; n0 < end; n0 += kWeightTile) {
      const int64_t n1 = std::min(end, n0 + kWeightTile);
      // packed codes read by more than one row tile: unpacked once into int8 bytes (L1), not per tile
      const int8_t* unpacked = kBytes || rows <= kRowTile ? nullptr : unpack_rows<Codes>(w, row_bytes, n0, n1, k);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        auto finish = [&](int64_t j, int t, float value, const float* orow) { store(j, r0 + t, value, orow); };
        if constexpr (kIntActivations) {
          // one row (the last tile, read from the codes as stored: has_one_row_pass's condition, whose
          // xs_blocks and correction it reads): up to kOneRowWeights weight rows per pass
          if (tile == 1 && has_one_row_pass) {
            auto pass = [&](auto width, int64_t j) {
              constexpr int kWeights = decltype(width)::value;
              weight_scales.prefetch_rows(j + kScaleAheadRows, j + kScaleAheadRows + kWeights, n);
              if (has_offsets) weight_offsets.prefetch_rows(j + kScaleAheadRows, j + kScaleAheadRows + kWeights, n);
              for (int r = 0; r < kWeights; ++r) weight_scales.row(j + r, scale_rows + r * nb, xs_blocks);
              acts.template dot_rows<kWeights, Codes>(w + j * row_bytes, row_bytes, scale_rows, nb, correction, block,
                                                      r0, dots);
              for (int r = 0; r < kWeights; ++r)
                finish(j + r, 0, dots[r], has_offsets ? weight_offsets.row(j + r, offset_rows) : nullptr);
            };
            int64_t j = n0;
            for (; j + kOneRowWeights <= n1; j += kOneRowWeights) pass(std::integral_constant<int, kOneRowWeights>{}, j);
            if (j + 2 <= n1) {
              pass(std::integral_constant<int, 2>{}, j);
              j += 2;
            }
            if (j < n1) pass(std::integral_constant<int, 1>{}, j);
            continue;
          }
        }
        for (int64_t j = n0; j < n1; ++j) {
          const float* sr = weight_scales.row(j, scale_rows);
          const float* orow = has_offsets ? weight_offsets.row(j, offset_rows) : nullptr;
          if (unpacked != nullptr) {
            dot_tile<ByteCodes>(acts, reinterpret_cast<const uint8_t*>(unpacked + (j - n0) * k), sr, block, r0,
                                tile, dots);
          } else {
            dot_tile<Codes>(acts, w + j * row_bytes, sr, block, r0, tile, dots);
          }
          for (int t = 0; t < tile; ++t) finish(j, t, dots[t], orow);
        }
      }
    }
  }
};

// y = x @ W.T for one activation format: argument checks, then BlockGemm's rows split over threads.
template <class Activations, class Codes = ByteCodes>
torch::Tensor block_linear_impl(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                const c10::optional<torch::Tensor>& offsets, int64_t block, bool bf16_out,
                                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  constexpr bool kBytes = std::is_same<Codes, ByteCodes>::value;
  TORCH_CHECK(codes.dtype() == (kBytes ? torch::kInt8 : torch::kUInt8) && codes.dim() == 2 && codes.is_contiguous(),
              kBytes ? "codes: int8 [N, K]" : "packed codes: uint8 [N, K * bits / 8]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  const int64_t row_bytes = k / 32 * Codes::kStepBytes;
  TORCH_CHECK(codes.size(1) == row_bytes && k % Activations::kKMultiple == 0,
              "K must match the codes and be a multiple of ", Activations::kKMultiple);
  const BlockValues weight_scales(scales, n, k, block, "scales");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  const BlockValues weight_offsets = has_offsets ? BlockValues(*offsets, n, k, block, "offsets") : BlockValues();
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK((bias->dtype() == torch::kFloat32 || bias->dtype() == torch::kBFloat16) && bias->dim() == 1
                && bias->is_contiguous() && bias->size(0) == n, "bias: contiguous float32 or bfloat16 [N]");
  }
  auto out = torch::empty({rows, n}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  if (rows == 0 || n == 0) return out;
  const float* bias32 = has_bias && bias->dtype() == torch::kFloat32 ? bias->data_ptr<float>() : nullptr;
  const c10::BFloat16* bias16 = has_bias && bias->dtype() == torch::kBFloat16 ? bias->data_ptr<c10::BFloat16>()
                                                                               : nullptr;
  const BlockGemm<Activations, Codes> gemm(float_rows(x, rows * k), rows, k, n, static_cast<const uint8_t*>(codes.data_ptr()),
                                           weight_scales, weight_offsets, has_offsets, block, bias32, bias16,
                                           bf16_out ? nullptr : out.data_ptr<float>(),
                                           bf16_out ? out.data_ptr<c10::BFloat16>() : nullptr);
  at::parallel_for(0, n, gemm.grain, [&](int64_t begin, int64_t end) { gemm.rows(begin, end); });
  return out;
}

// ---- One row's MLP half of a decoder layer in one call (the flat decode's 1-row float32 step) ----
//
// Llama: o -> add + RMSNorm -> gate_up -> act(gate) * up -> down -> add + RMSNorm of the next layer (or
// the final norm); Gemma 3: o -> (1 + w) norm, added to the residual -> pre-feedforward norm -> gate_up ->
// act(gate) * up -> down -> post-feedforward norm, added -> the next layer's input norm. The same kernels
// as the six (Gemma: eight) calls the flat decode makes for them (BlockGemm for the three projections;
// the fused ops' float32 norms and act * up, fused_ops.cpp, in the same float operations and order),
// inside one OpenMP parallel region with barriers between the steps instead of three regions, the
// Python calls and their output tensors. act * up is split over the threads (an elementwise op: the same
// floats on any split); the norms and each projection's activation rounding run on the calling thread
// (thread 0) while the others wait at the barrier, as they wait between regions. fused_ops.cpp is built
// without FMA contraction and this file with GCC's default (fast) contraction, so every product here
// that an add or subtract takes is rounded first (``rounded8``): the same floats.

using servelm_activation::activate8;
using servelm_activation::rounded8;

// act(g) * u for i in [begin, end) (multiples of 8), KIND 0 SiLU, 1 GELU tanh: fused_ops.cpp's
// act_and_mul loop on float32 rows (servelm_activation.h's lanes)
template <int KIND>
void act_mul(const float* g, const float* u, float* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(activate8<KIND>(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
}

// 1 / sqrt(mean(x^2) + eps) of one row: fused_ops.cpp's inv_rms (the sum of squares in 16 partial sums,
// lane j over i = j mod 16, then added in order), k a multiple of 16
float inv_rms_row(const float* x, int64_t k, float eps) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    lo = _mm256_add_ps(lo, rounded8(_mm256_mul_ps(a, a)));
    hi = _mm256_add_ps(hi, rounded8(_mm256_mul_ps(b, b)));
  }
  alignas(32) float partial[16];
  _mm256_store_ps(partial, lo);
  _mm256_store_ps(partial + 8, hi);
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += partial[j];
  return 1.f / std::sqrt(total / float(k) + eps);
}

// sum = x + residual, out = w * (sum * r): fused_ops.cpp's float32 add_rms_norm of one row (Llama's
// pre-add)
void add_rms_norm_row(const float* x, const float* residual, const float* w, float* sum, float* out, int64_t k,
                      float eps) {
  for (int64_t i = 0; i < k; i += 8)
    _mm256_storeu_ps(sum + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
  const __m256 r = _mm256_set1_ps(inv_rms_row(sum, k, eps));
  for (int64_t i = 0; i < k; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(sum + i), r)));
}

// out = (x * r) * (1 + w), then residual + out where a residual is given: fused_ops.cpp's float32
// rms_norm of one row with Gemma's offset scale (and its post-add)
void offset_norm_row(const float* x, const float* residual, const float* w, float* out, int64_t k, float eps) {
  const __m256 r = _mm256_set1_ps(inv_rms_row(x, k, eps));
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 normed = rounded8(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r),
                                                 _mm256_add_ps(one, _mm256_loadu_ps(w + i))));
    _mm256_storeu_ps(out + i, residual != nullptr ? _mm256_add_ps(_mm256_loadu_ps(residual + i), normed) : normed);
  }
}

// One projection's block weight on the one-row kernel of ``kind`` (the Python function it stands for:
// DecodeMlp's docstring) with float32 rows in and out.
struct Projection {
  int64_t kind, n, k, block, bits;
  torch::Tensor codes, scales, offsets;
  BlockValues scale_values, offset_values;
  bool has_offsets;

  torch::Tensor bias;   // float32 [n], added to each output as block_linear_impl adds it (or undefined)

  Projection(int64_t kind_, torch::Tensor codes_, torch::Tensor scales_, c10::optional<torch::Tensor> offsets_,
             int64_t block_, int64_t k_, const char* what, c10::optional<torch::Tensor> bias_ = c10::nullopt)
      : kind(kind_), n(codes_.size(0)), k(k_), block(block_), bits(8), codes(std::move(codes_)),
        scales(std::move(scales_)), has_offsets(offsets_.has_value() && offsets_->defined()) {
    if (bias_.has_value() && bias_->defined()) {
      bias = *bias_;
      TORCH_CHECK(bias.dtype() == torch::kFloat32 && bias.dim() == 1 && bias.is_contiguous() && bias.size(0) == n,
                  what, ": bias contiguous float32 [N]");
    }
    TORCH_CHECK(kind >= 0 && kind <= 5, what, ": kind 0-5");
    const bool bytes = kind <= 1;
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.dtype() == (bytes ? torch::kInt8 : torch::kUInt8),
                what, ": contiguous codes, int8 (block_linear*) or uint8 (packed_*)");
    TORCH_CHECK((block == 16 || block == 32) && k % 32 == 0, what, ": block 16 or 32, K a multiple of 32");
    if (!bytes) {
      bits = codes.size(1) * 8 / k;
      TORCH_CHECK(codes.size(1) * 8 == k * bits && bits >= 4 && bits <= 6, what, ": packed codes of 4, 5 or 6 bits");
    } else {
      TORCH_CHECK(codes.size(1) == k, what, ": int8 codes [N, K]");
    }
    scale_values = BlockValues(scales, n, k, block, what);
    if (has_offsets) {
      offsets = *offsets_;
      offset_values = BlockValues(offsets, n, k, block, what);
    }
  }

  template <class A, class C>
  std::unique_ptr<RowRange> make(const float* x, float* y) const {
    return std::make_unique<BlockGemm<A, C>>(x, 1, k, n, static_cast<const uint8_t*>(codes.data_ptr()), scale_values,
                                             offset_values, has_offsets, block,
                                             bias.defined() ? bias.data_ptr<float>() : nullptr, nullptr, y, nullptr);
  }

  template <class A, bool CENTERED>
  std::unique_ptr<RowRange> make_packed(const float* x, float* y) const {
    if (bits == 4) return make<A, PackedCodes<4, CENTERED>>(x, y);
    if (bits == 5) return make<A, PackedCodes<5, CENTERED>>(x, y);
    return make<A, PackedCodes<6, CENTERED>>(x, y);
  }

  // y [n] = W x [k] on the calling thread's prepared activations (BlockGemm's constructor); its rows()
  // then run on any threads
  std::unique_ptr<RowRange> gemm(const float* x, float* y) const {
    switch (kind) {
      case 0: return make<Int16Activations, ByteCodes>(x, y);
      case 1: return make<Int8Activations, ByteCodes>(x, y);
      case 2: return make_packed<Int16Activations, false>(x, y);
      case 3: return make_packed<Int16Activations, true>(x, y);
      case 4: return make_packed<Int8Activations, false>(x, y);
      default: return make_packed<Int8Activations, true>(x, y);
    }
  }
};

// Thread ``tid`` of ``threads``' share of ``gemm``'s outputs, split as at::parallel_for splits them
inline void run_share(const RowRange& gemm, int tid, int threads) {
  const int64_t used = std::min<int64_t>(threads, (gemm.n + gemm.grain - 1) / gemm.grain);
  const int64_t chunk = (gemm.n + used - 1) / used;
  const int64_t begin = tid * chunk;
  if (tid < used && begin < gemm.n) gemm.rows(begin, std::min(gemm.n, begin + chunk));
}

// fn(tid, threads, barrier) on torch's threads in one OpenMP parallel region (``barrier()``: every thread
// waits for the others), or as thread 0 of 1 on the calling thread inside another region or without OpenMP
template <class Fn>
void in_one_region(const Fn& fn) {
#ifdef _OPENMP
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    fn(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
    });
    return;
  }
#endif
  fn(0, 1, [] {});
}

class DecodeMlp {
 public:
  // norms: [post-attention] (Llama: its add + RMSNorm before the MLP) or [post-attention,
  // pre-feedforward, post-feedforward] (Gemma: (1 + w) norms, the post-norms' residual adds after them)
  DecodeMlp(int64_t o_kind, torch::Tensor o_codes, torch::Tensor o_scales, c10::optional<torch::Tensor> o_offsets,
            int64_t o_block, int64_t o_k, std::vector<torch::Tensor> norms, double eps,
            int64_t gate_up_kind, torch::Tensor gate_up_codes, torch::Tensor gate_up_scales,
            c10::optional<torch::Tensor> gate_up_offsets, int64_t gate_up_block,
            int64_t down_kind, torch::Tensor down_codes, torch::Tensor down_scales,
            c10::optional<torch::Tensor> down_offsets, int64_t down_block, int64_t activation)
      : o_(o_kind, std::move(o_codes), std::move(o_scales), std::move(o_offsets), o_block, o_k, "o"),
        hidden_(o_.n),
        gate_up_(gate_up_kind, std::move(gate_up_codes), std::move(gate_up_scales), std::move(gate_up_offsets),
                 gate_up_block, hidden_, "gate_up"),
        inner_(gate_up_.n / 2),
        down_(down_kind, std::move(down_codes), std::move(down_scales), std::move(down_offsets), down_block, inner_,
              "down"),
        norms_(std::move(norms)), eps_(static_cast<float>(eps)), activation_(activation),
        gemma_(norms_.size() == 3) {
    TORCH_CHECK(activation == 0 || activation == 1, "activation: 0 (SiLU) or 1 (GELU tanh)");
    TORCH_CHECK(norms_.size() == 1 || norms_.size() == 3,
                "norms: [post-attention] (Llama) or [post-attention, pre-feedforward, post-feedforward] (Gemma)");
    TORCH_CHECK(hidden_ % 16 == 0 && gate_up_.n % 16 == 0 && down_.n == hidden_,
                "hidden size a multiple of 16, gate_up [2 I, H] with I a multiple of 8, down [H, I]");
    for (const auto& norm : norms_) check_norm(norm, "norms");
  }

  // What one run's phases share: the inputs, the outputs and the projection being computed.
  struct Call {
    const float* x;          // attended [o's K]
    const float* residual;   // hidden [H]
    const float* norm_weight;
    float next_eps;
    float* out_normed;
    float* out_summed;
    float* buffer;           // buffer_floats() floats: o's (then down's) output, the post-attention sum and
                             // norm, gate_up's output, act * up
    std::unique_ptr<RowRange> gemm;
  };

  int64_t buffer_floats() const { return 3 * hidden_ + gate_up_.n + inner_; }
  int64_t hidden() const { return hidden_; }
  int64_t o_k() const { return o_.k; }

  // Thread ``tid`` of ``threads``' part of one run (every thread of the region calls it; ``barrier`` waits
  // for all of them): the projections split over the threads, the norms and each projection's activation
  // rounding on thread 0 (the calling thread, whose scratch buffers hold them).
  template <class Barrier>
  void phases(int tid, int threads, const Barrier& barrier, Call& call) const {
    float* projected = call.buffer;   // o's output, then down's
    float* mid_sum = call.buffer + hidden_;
    float* mid_normed = call.buffer + 2 * hidden_;
    float* gate_up = call.buffer + 3 * hidden_;
    float* act = gate_up + gate_up_.n;
    if (tid == 0) call.gemm = o_.gemm(call.x, projected);
    barrier();
    run_share(*call.gemm, tid, threads);
    barrier();
    if (tid == 0) {
      if (gemma_) {   // hidden + norm(o), then the pre-feedforward norm of that
        offset_norm_row(projected, call.residual, norms_[0].data_ptr<float>(), mid_sum, hidden_, eps_);
        offset_norm_row(mid_sum, nullptr, norms_[1].data_ptr<float>(), mid_normed, hidden_, eps_);
      } else {
        add_rms_norm_row(projected, call.residual, norms_[0].data_ptr<float>(), mid_sum, mid_normed, hidden_, eps_);
      }
      call.gemm = gate_up_.gemm(mid_normed, gate_up);
    }
    barrier();
    run_share(*call.gemm, tid, threads);
    barrier();
    const int64_t chunk = ((inner_ + threads - 1) / threads + 7) / 8 * 8;
    const int64_t begin = std::min(inner_, tid * chunk), end = std::min(inner_, (tid + 1) * chunk);
    if (activation_ == 0) act_mul<0>(gate_up, gate_up + inner_, act, begin, end);
    else act_mul<1>(gate_up, gate_up + inner_, act, begin, end);
    barrier();
    if (tid == 0) call.gemm = down_.gemm(act, projected);
    barrier();
    run_share(*call.gemm, tid, threads);
    barrier();
    if (tid == 0) {
      if (gemma_) {   // the sum + norm(down), then the next norm of that
        offset_norm_row(projected, mid_sum, norms_[2].data_ptr<float>(), call.out_summed, hidden_, eps_);
        offset_norm_row(call.out_summed, nullptr, call.norm_weight, call.out_normed, hidden_, call.next_eps);
      } else {
        add_rms_norm_row(projected, mid_sum, call.norm_weight, call.out_summed, call.out_normed, hidden_,
                         call.next_eps);
      }
    }
  }

  // (norm(h), h) for the layer's output h (Llama: x + hidden with x the MLP's output; Gemma: the
  // post-feedforward norm's sum), ``norm`` the next layer's input norm (or the model's final norm; Gemma's
  // (1 + w)): what the separate calls give for attended [1, o's K] and hidden [1, H], float32
  std::vector<torch::Tensor> run(const torch::Tensor& attended, const torch::Tensor& hidden, const torch::Tensor& norm,
                                 double norm_eps) const {
    TORCH_CHECK(attended.dtype() == torch::kFloat32 && attended.dim() == 2 && attended.size(0) == 1
                && attended.size(1) == o_.k && attended.is_contiguous(), "attended: contiguous float32 [1, K]");
    TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 2 && hidden.size(0) == 1
                && hidden.size(1) == hidden_ && hidden.is_contiguous(), "hidden: contiguous float32 [1, H]");
    check_norm(norm, "norm");
    auto normed = torch::empty({1, hidden_}, hidden.options());
    auto summed = torch::empty({1, hidden_}, hidden.options());
    // (scratch slot 0 is also the bf16 rows' and never read here: every row is float32)
    Call call{attended.data_ptr<float>(), hidden.data_ptr<float>(), norm.data_ptr<float>(),
              static_cast<float>(norm_eps), normed.data_ptr<float>(), summed.data_ptr<float>(),
              scratch<float>(0, buffer_floats()), nullptr};
    in_one_region([&](int tid, int threads, auto barrier) { phases(tid, threads, barrier, call); });
    return {normed, summed};
  }

  void check_norm(const torch::Tensor& w, const char* what) const {
    TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 1 && w.size(0) == hidden_ && w.is_contiguous(), what,
                ": contiguous float32 [H]");
  }

 private:
  Projection o_;
  int64_t hidden_;
  Projection gate_up_;
  int64_t inner_;
  Projection down_;
  std::vector<torch::Tensor> norms_;
  float eps_;
  int64_t activation_;
  bool gemma_;
};

// ---- Every layer of a one-row float32 decode step in one call ----
//
// DecodeStack runs the flat decode's one-row float32 step through all its layers inside one OpenMP
// parallel region: per layer the QKV projection (BlockGemm, its bias added as block_linear_impl adds it),
// the q/k norms and RoPE of the row, its K and V written at the row's slot of the layer's pools, attention
// (paged_decode.cpp's tasks for the row: segments of its columns, their query heads split where the
// segments are fewer than the threads; thread t taking tasks t, t + threads, ...; then the segments'
// merge), then DecodeMlp's phases (o .. down and the next layer's input norm, the last layer's the
// model's final norm). The norm + RoPE and attention functions are those of the loaded fused-ops and
// paged-decode builds (capsules given at construction: fused_ops.cpp's norm_rope_qkv_row_f32,
// paged_decode.cpp's RowAttentionF32, servelm_row_attention.h), so every float is the one
// the per-layer calls compute; what goes is their Python, their argument checks and their parallel regions.
using NormRopeRow = void (*)(float*, int64_t, int64_t, int64_t, const float*, const float*, const float*,
                             const float*, float, bool);

void* capsule_pointer(const py::capsule& capsule, const char* name) {
  TORCH_CHECK(capsule.name() != nullptr && std::strcmp(capsule.name(), name) == 0, "expected the capsule ", name);
  return capsule.get_pointer();
}

struct StackLayer {
  Projection qkv;
  int64_t heads, kv_heads, d;
  torch::Tensor q_norm, k_norm;   // float32 [d], or undefined (no q/k norms)
  float head_eps;
  bool offset;                    // (1 + w) q/k norms (Gemma)
  int64_t rope, window;           // which of a step's cos/sin rows and slots/spans the layer reads
  float scale;
  torch::Tensor input_norm;       // float32 [H]: this layer's input norm (the previous layer's call makes it)
  float input_eps;
  std::shared_ptr<DecodeMlp> mlp;
};

class DecodeStack {
 public:
  DecodeStack(const py::capsule& norm_rope, const py::capsule& attend)
      : norm_rope_(reinterpret_cast<NormRopeRow>(capsule_pointer(norm_rope, "servelm.norm_rope_qkv_row_f32"))),
        attend_(*static_cast<const RowAttentionF32*>(capsule_pointer(attend, "servelm.row_attention_f32"))) {}

  void add_layer(int64_t qkv_kind, torch::Tensor qkv_codes, torch::Tensor qkv_scales,
                 c10::optional<torch::Tensor> qkv_offsets, int64_t qkv_block, c10::optional<torch::Tensor> qkv_bias,
                 int64_t heads, int64_t kv_heads, int64_t d, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double head_eps, bool offset, int64_t rope, int64_t window,
                 double scale, torch::Tensor input_norm, double input_eps, std::shared_ptr<DecodeMlp> mlp) {
    TORCH_CHECK(mlp != nullptr, "mlp: a DecodeMlp");
    const int64_t hidden = mlp->hidden();
    TORCH_CHECK(layers_.empty() || (layers_[0].mlp->hidden() == hidden
                                    && layers_[0].mlp->buffer_floats() == mlp->buffer_floats()),
                "every layer of one hidden size and one MLP shape");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && d > 0 && d % 2 == 0 && heads * d == mlp->o_k(),
                "heads a multiple of kv_heads, even d, heads * d the o projection's K");
    TORCH_CHECK(rope >= 0 && window >= 0, "rope, window: indices");
    Projection qkv(qkv_kind, std::move(qkv_codes), std::move(qkv_scales), std::move(qkv_offsets), qkv_block, hidden,
                   "qkv", std::move(qkv_bias));
    TORCH_CHECK(qkv.n == (heads + 2 * kv_heads) * d, "qkv: (heads + 2 kv_heads) * d outputs");
    auto head_norm = [&](const c10::optional<torch::Tensor>& w) {
      if (!w.has_value() || !w->defined()) return torch::Tensor();
      TORCH_CHECK(w->dtype() == torch::kFloat32 && w->dim() == 1 && w->size(0) == d && w->is_contiguous(),
                  "q/k norm: contiguous float32 [d]");
      return *w;
    };
    mlp->check_norm(input_norm, "input_norm");
    qkv_floats_ = std::max(qkv_floats_, qkv.n);
    attended_floats_ = std::max(attended_floats_, heads * d);
    layers_.push_back(StackLayer{std::move(qkv), heads, kv_heads, d, head_norm(q_norm), head_norm(k_norm),
                                 static_cast<float>(head_eps), offset, rope, window, static_cast<float>(scale),
                                 std::move(input_norm), static_cast<float>(input_eps), std::move(mlp)});
  }

  // (final_norm(h), h) for the last layer's output h, from normed = the first layer's input norm of
  // hidden [1, H]: cos[r], sin[r] [1, d] the rows of rope r; slot_mapping [1] the row's slot; slots[w]
  // [1, C] and spans[w] [1] the row's columns under window w; k_pools[l], v_pools[l] [slots, kv_heads, d]
  // layer l's pools (float32, contiguous)
  std::vector<torch::Tensor> run(const torch::Tensor& normed, const torch::Tensor& hidden,
                                 const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                 const torch::Tensor& slot_mapping, const std::vector<torch::Tensor>& slots,
                                 const std::vector<torch::Tensor>& spans, const std::vector<torch::Tensor>& k_pools,
                                 const std::vector<torch::Tensor>& v_pools, const torch::Tensor& final_norm,
                                 double final_eps) {
    TORCH_CHECK(!layers_.empty(), "no layers");
    const int64_t h_size = layers_[0].mlp->hidden();
    for (const auto* row : {&normed, &hidden}) {
      TORCH_CHECK(row->dtype() == torch::kFloat32 && row->dim() == 2 && row->size(0) == 1 && row->size(1) == h_size
                  && row->is_contiguous(), "normed, hidden: contiguous float32 [1, H]");
    }
    layers_[0].mlp->check_norm(final_norm, "final_norm");
    TORCH_CHECK(cos.size() == sin.size() && slots.size() == spans.size(), "a sin per cos, a span per slots");
    TORCH_CHECK(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(), "a K and V pool per layer");
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == 1, "slot_mapping: int64 [1]");
    const int64_t slot = slot_mapping.data_ptr<int64_t>()[0];
    std::vector<int64_t> columns(slots.size());
    for (size_t w = 0; w < slots.size(); ++w) {
      TORCH_CHECK(slots[w].scalar_type() == torch::kInt64 && slots[w].dim() == 2 && slots[w].size(0) == 1
                  && slots[w].stride(1) == 1 && spans[w].scalar_type() == torch::kInt64 && spans[w].numel() == 1,
                  "slots [1, C] with contiguous columns and spans [1], int64");
      columns[w] = spans[w].data_ptr<int64_t>()[0];
      TORCH_CHECK(columns[w] >= 1 && columns[w] <= slots[w].size(1), "span ", columns[w], " outside 1 .. C");
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      const StackLayer& layer = layers_[l];
      TORCH_CHECK(layer.rope < static_cast<int64_t>(cos.size()) && layer.window < static_cast<int64_t>(slots.size()),
                  "layer ", l, ": no rope ", layer.rope, " or window ", layer.window);
      for (const auto* row : {&cos[layer.rope], &sin[layer.rope]}) {
        TORCH_CHECK(row->dtype() == torch::kFloat32 && row->dim() == 2 && row->size(0) == 1
                    && row->size(1) == layer.d && row->stride(1) == 1, "cos, sin: float32 [1, d] with contiguous rows");
      }
      for (const auto* pool : {&k_pools[l], &v_pools[l]}) {
        TORCH_CHECK(pool->dtype() == torch::kFloat32 && pool->is_contiguous() && pool->dim() == 3
                    && pool->size(1) == layer.kv_heads && pool->size(2) == layer.d,
                    "pools: contiguous float32 [slots, kv_heads, d]");
        TORCH_CHECK(slot >= 0 && slot < pool->size(0), "slot ", slot, " outside the pool's ", pool->size(0));
      }
    }
    int64_t partial = 0;
    for (const StackLayer& layer : layers_)
      partial = std::max(partial, attend_.partial_floats(columns[layer.window], layer.heads, layer.d));
    if (static_cast<int64_t>(partial_.size()) < partial) partial_.resize(partial);
    auto normed_out = torch::empty({1, h_size}, hidden.options());
    auto summed_out = torch::empty({1, h_size}, hidden.options());
    const int64_t mlp_floats = layers_[0].mlp->buffer_floats();
    if (static_cast<int64_t>(buffer_.size()) < qkv_floats_ + attended_floats_ + 4 * h_size + mlp_floats)
      buffer_.resize(qkv_floats_ + attended_floats_ + 4 * h_size + mlp_floats);
    float* qkv_out = buffer_.data();
    float* attended = qkv_out + qkv_floats_;
    float* between = attended + attended_floats_;   // two (normed, summed) pairs, alternating by layer
    DecodeMlp::Call call{attended, nullptr, nullptr, 0.f, nullptr, nullptr, between + 4 * h_size, nullptr};
    std::unique_ptr<RowRange> gemm;
    auto body = [&](int tid, int threads, auto barrier) {
      const float* x = normed.data_ptr<float>();
      const float* residual = hidden.data_ptr<float>();
      for (size_t l = 0; l < layers_.size(); ++l) {
        const StackLayer& layer = layers_[l];
        if (tid == 0) gemm = layer.qkv.gemm(x, qkv_out);
        barrier();
        run_share(*gemm, tid, threads);
        barrier();
        const int64_t d = layer.d;
        float* k_pool = k_pools[l].data_ptr<float>();
        float* v_pool = v_pools[l].data_ptr<float>();
        if (tid == 0) {
          norm_rope_(qkv_out, layer.heads, layer.kv_heads, d, cos[layer.rope].data_ptr<float>(),
                     sin[layer.rope].data_ptr<float>(), layer.q_norm.defined() ? layer.q_norm.data_ptr<float>() : nullptr,
                     layer.k_norm.defined() ? layer.k_norm.data_ptr<float>() : nullptr, layer.head_eps, layer.offset);
          const int64_t row = layer.kv_heads * d;
          std::memcpy(k_pool + slot * row, qkv_out + layer.heads * d, row * sizeof(float));
          std::memcpy(v_pool + slot * row, qkv_out + layer.heads * d + row, row * sizeof(float));
        }
        barrier();
        // The row's attention tasks (paged_decode.cpp's segments of columns, their heads in parts where
        // the segments are fewer than the threads), thread t taking tasks t, t + threads, ...; then, where
        // the row has more than one segment, the merge of their partial results, the heads split over the
        // threads
        const int64_t* row_slots = slots[layer.window].data_ptr<int64_t>();
        const int64_t n = columns[layer.window];
        int64_t parts;
        const int64_t tasks = attend_.plan(n, layer.heads, threads, &parts);
        for (int64_t task = tid; task < tasks; task += threads) {
          attend_.task(qkv_out, k_pool, v_pool, row_slots, n, layer.kv_heads, layer.heads, d, layer.scale, parts,
                       task, attended, partial_.data());
        }
        if (attend_.partial_floats(n, layer.heads, d) > 0) {
          barrier();
          attend_.merge(n, partial_.data(), layer.heads, d, tid * layer.heads / threads,
                        (tid + 1) * layer.heads / threads, attended);
        }
        const bool last = l + 1 == layers_.size();
        float* out_normed = last ? normed_out.data_ptr<float>() : between + (l % 2) * 2 * h_size;
        float* out_summed = last ? summed_out.data_ptr<float>() : out_normed + h_size;
        if (tid == 0) {   // the phases' inputs, set before the barrier every thread passes before reading them
          call.residual = residual;
          call.norm_weight = last ? final_norm.data_ptr<float>() : layers_[l + 1].input_norm.data_ptr<float>();
          call.next_eps = last ? static_cast<float>(final_eps) : layers_[l + 1].input_eps;
          call.out_normed = out_normed;
          call.out_summed = out_summed;
        }
        barrier();
        layer.mlp->phases(tid, threads, barrier, call);
        x = out_normed;
        residual = out_summed;
      }
    };
    in_one_region(body);
    return {normed_out, summed_out};
  }

 private:
  NormRopeRow norm_rope_;
  RowAttentionF32 attend_;
  std::vector<StackLayer> layers_;
  int64_t qkv_floats_ = 0, attended_floats_ = 0;   // the largest QKV row and attention output of the layers
  std::vector<float> buffer_;   // the QKV row, attention's output, the layers' outputs, the MLP phases' buffer
  std::vector<float> partial_;  // attention's partial results of a row of more than one segment
};

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

// The packed codes' functions: the bit width follows from the codes' row bytes (K * bits / 8).
template <class Activations, bool CENTERED>
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                            c10::optional<torch::Tensor> offsets, int64_t block, bool bf16_out,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) % 32 == 0,
              "x [M, K], K a multiple of 32; packed [N, bytes]");
  const int64_t k = x.size(1), bits = packed.size(1) * 8 / std::max<int64_t>(k, 1);
  TORCH_CHECK(packed.size(1) * 8 == k * bits && bits >= 4 && bits <= 6, "packed codes: ", packed.size(1),
              " bytes per row is not 4, 5 or 6 bits for K = ", k);
  switch (bits) {
    case 4: return block_linear_impl<Activations, PackedCodes<4, CENTERED>>(x, packed, scales, offsets, block, bf16_out, bias);
    case 5: return block_linear_impl<Activations, PackedCodes<5, CENTERED>>(x, packed, scales, offsets, block, bf16_out, bias);
    default: return block_linear_impl<Activations, PackedCodes<6, CENTERED>>(x, packed, scales, offsets, block, bf16_out, bias);
  }
}

#define BLOCK_LINEAR_ARGS py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("block"), \
                          py::arg("bf16_out") = false, py::arg("bias") = py::none()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = "avx2";
  m.attr("COMPACT_SCALES") = true;   // scales and offsets also as BlockValues' float16 and int8 layouts
  m.attr("FLOAT_TILE_ROWS") = kFloatTileRows;   // block_linear_float's weight tiles from this many rows
  m.def("block_linear_a16", &block_linear_a16,
        "activations rounded to 16 bits per 32 inputs (int16 x int16 vpmaddwd, AVX2)", BLOCK_LINEAR_ARGS);
  m.def("block_linear", &block_linear, "activations rounded to int8 per 32 inputs as llama.cpp (AVX2)",
        BLOCK_LINEAR_ARGS);
  m.def("block_linear_float", &block_linear_float,
        "float activations (weights dequantized in registers; no activation rounding; AVX2 + FMA)",
        BLOCK_LINEAR_ARGS);
#define PACKED_ARGS py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("offsets"), py::arg("block"), \
                    py::arg("bf16_out") = false, py::arg("bias") = py::none()
  m.def("packed_a16", &packed_linear<Int16Activations, false>,
        "block_linear_a16 on codes packed at their bit width (gguf_blocks.PackedCodes)", PACKED_ARGS);
  m.def("packed_a16_centered", &packed_linear<Int16Activations, true>,
        "packed_a16 on signed codes stored plus 2^(bits - 1)", PACKED_ARGS);
  m.def("packed_float", &packed_linear<FloatActivations, false>,
        "block_linear_float on codes packed at their bit width", PACKED_ARGS);
  m.def("packed_float_centered", &packed_linear<FloatActivations, true>,
        "packed_float on signed codes stored plus 2^(bits - 1)", PACKED_ARGS);
  m.def("packed_a8", &packed_linear<Int8Activations, false>, "block_linear on codes packed at their bit width",
        PACKED_ARGS);
  m.def("packed_a8_centered", &packed_linear<Int8Activations, true>,
        "packed_a8 on signed codes stored plus 2^(bits - 1)", PACKED_ARGS);
  py::class_<DecodeMlp, std::shared_ptr<DecodeMlp>>(m, "DecodeMlp",
                        "one row's MLP half in one call (float32): o -> add + RMSNorm -> gate_up -> act * up -> down "
                        "-> add + RMSNorm (Llama), or o -> norm + add -> norm -> gate_up -> act * up -> down -> "
                        "norm + add -> norm with (1 + w) norms (Gemma); a projection's kind: 0 block_linear_a16, "
                        "1 block_linear, 2 packed_a16, 3 packed_a16_centered, 4 packed_a8, 5 packed_a8_centered; "
                        "activation 0 SiLU, 1 GELU tanh")
      .def(py::init<int64_t, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t,
                    std::vector<torch::Tensor>, double, int64_t, torch::Tensor, torch::Tensor,
                    c10::optional<torch::Tensor>, int64_t, int64_t, torch::Tensor, torch::Tensor,
                    c10::optional<torch::Tensor>, int64_t, int64_t>(),
           py::arg("o_kind"), py::arg("o_codes"), py::arg("o_scales"), py::arg("o_offsets"), py::arg("o_block"),
           py::arg("o_k"), py::arg("norms"), py::arg("eps"), py::arg("gate_up_kind"), py::arg("gate_up_codes"),
           py::arg("gate_up_scales"), py::arg("gate_up_offsets"), py::arg("gate_up_block"), py::arg("down_kind"),
           py::arg("down_codes"), py::arg("down_scales"), py::arg("down_offsets"), py::arg("down_block"),
           py::arg("activation"))
      .def("run", &DecodeMlp::run, "(norm(h), h) of the layer's output h, norm the next layer's input norm",
           py::arg("attended"), py::arg("hidden"), py::arg("norm"), py::arg("norm_eps"));
  py::class_<DecodeStack>(m, "DecodeStack",
                          "every layer of a one-row float32 decode step in one call: per layer QKV (+ bias), q/k "
                          "norms + RoPE and attention through the given capsules, then a DecodeMlp")
      .def(py::init<const py::capsule&, const py::capsule&>(), py::arg("norm_rope"), py::arg("attend"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("qkv_kind"), py::arg("qkv_codes"), py::arg("qkv_scales"),
           py::arg("qkv_offsets"), py::arg("qkv_block"), py::arg("qkv_bias"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("d"), py::arg("q_norm"), py::arg("k_norm"), py::arg("head_eps"), py::arg("offset"), py::arg("rope"),
           py::arg("window"), py::arg("scale"), py::arg("input_norm"), py::arg("input_eps"), py::arg("mlp"))
      .def("run", &DecodeStack::run, "(final_norm(h), h) of the last layer's output h", py::arg("normed"),
           py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("slots"),
           py::arg("spans"), py::arg("k_pools"), py::arg("v_pools"), py::arg("final_norm"), py::arg("final_eps"));
}
