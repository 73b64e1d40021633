// Greedy LM-head screen (servelm/model/gguf/lm_head_screen.py): approximate logits of every
// vocabulary row from the top 5 bits of its Q8_0 codes, with a rigorous per-row error bound, for
// many activation rows at once.
//
// A Q8_0 row is codes c (int8 in [-127, 127]) with one float scale d per 32 inputs. The screen
// keeps s = c >> 3 (floor(c / 8), in [-16, 15]) as u = s + 16 in [0, 31]: 5 bits per weight. The
// screen's code is the middle of the 8 codes that share s: c' = 8 s + 3.5 = 8 u - 124.5, so
// |c - c'| <= 3.5.
//
// Layout: vocabulary rows in tiles of 16 (the last tile padded with zero rows). Per tile and per
// 8 inputs (k0 .. k0 + 7), 80 bytes: 64 nibble bytes, byte 4 r + j holding u >> 1 of row r at input
// k0 + j (low nibble) and k0 + 4 + j (high nibble), then two 64-bit masks of u & 1 (bit 4 r + j;
// the first for the low nibbles, the second for the high). Unpacked, one 512-bit register holds 4
// inputs of 16 rows: a VNNI product against 4 activation bytes broadcast to every lane gives the
// 16 rows' partial dots at once, so the unpacked weights serve every activation row of the call
// (register blocking over rows) and the float work is once per 32-input block, not per 64 inputs.
// The scales are copied tiled too ([tiles, K / 32, 16], one vector per tile and block), as fp16 where
// every scale is an fp16 value (a Q8_0 head's d: half the bytes, widened exactly), else float32.
//
// Activations are rounded exactly as the exact int16 kernel (gguf_kernel.cpp, Int16Activations)
// rounds them: q = round(x / dx), dx = amax / 32512 per 32 inputs (the same code, the same IEEE
// float operations, so the same q and dx), split q = 256 hi + lo with hi, lo signed bytes (the
// integer product u . q is exact either way). With Q = sum over a block of q and A = sum of |q|:
//   exact  T = sum_b d_b dx_b (c_b . q_b)
//   screen S = sum_b d_b dx_b (8 u_b . q_b - 124.5 Q_b)           (c' = 8 u - 124.5)
//   |T - S| <= 3.5 sum_b d_b dx_b A_b = 3.5 D
// The kernel returns S and D per row; the caller adds a float-rounding margin proportional to D.
//
// Two builds of this one source (lm_head_screen.py picks the one beside the head's block kernel):
// compiled with AVX512-VNNI, the layout above; compiled with AVX2 + FMA only (no __AVX512VNNI__),
// tiles of 8 vocabulary rows (one 32-bit lane of a 256-bit register each) and per tile and 32-input
// block 160 bytes: 4 planes of 32 bytes, then one more. Step s covers inputs 4 s .. 4 s + 3; byte
// 4 r + j of plane m holds u of row r at input 4 m + j (step m) in its low 5 bits and u >> 2 of
// input 16 + 4 m + j (step 4 + m) in its top 3; byte 4 r + j of the last plane holds u & 3 of input
// 16 + 4 m + j at bits 2 m, 2 m + 1. Steps 0-3 unpack with one AND, steps 4-7 with two shifts, two
// ANDs and an OR (an earlier layout, 4 nibble planes and a plane of u & 1, took 5-6 operations for
// every step; the AVX-512 layout's 64-bit masks need a masked add AVX2 lacks). Still 5 bits per weight. AVX2 has no VNNI: u . q is
// vpmaddubsw (u unsigned, a signed byte of q: pairs |2 * 31 * 128| = 7936, never saturated) summed
// in int16 over 4 steps of 4 inputs (4 * 7936 = 31744 < 32767: exact), widened by vpmaddwd (x 256
// for the high bytes, x 1 for the low ones) twice per block: the same exact integer u . q.
//
// The float rounding margin (lm_head_screen.py rounding_margin), for either build and either exact
// kernel (gguf_kernel.cpp on AVX-512, gguf_kernel_avx2.cpp's block_linear_a16 on AVX2), with
// u = 2^-24, nb = K / 32 blocks and D* the exact value of D:
//   exact kernel: the block's int32 lanes are exact (AVX2: 4 products of |q| <= 32512, |c| <= 127,
//     under 2^24, so the float conversion is exact too; AVX-512 alike), scaled by fl(d dx) (1
//     rounding) and summed by nb fmas per lane, then a horizontal sum (3-4 roundings): error
//     <= (nb + 5) u sum |d dx c q| <= (nb + 5) u 127 D*;
//   screen: fl(u . q) and fl(8 dx) x it (2 roundings), nb fmas into S (terms |8 u q| <= 248 |q|), the
//     offset's nb fmas of fl(dx Q) (Q exact in float, |Q| <= 32 * 32512 < 2^24), one fnmadd: error
//     <= (nb + 3) u (248 + 124.5) D*; D itself is low by at most (nb + 1) u D*, and S +- e D is one
//     fma rounding of |S| + e D <= ~377 D*.
//   Together |T - S| <= 3.5 D* + (504 nb + 2004) u D*: a margin of twice (504 nb + 2004) u, at least
//   5e-3 (K = 896: 9.6e-4 needed), covers both.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SCREEN_AVX512 1
constexpr int64_t kTile = 16;          // vocabulary rows per tile (one 32-bit lane each)
using Vec = __m512;                    // one float per vocabulary row of a tile
using IVec = __m512i;
constexpr const char* kIsa = "avx512_vnni";
#else
constexpr int64_t kTile = 8;
using Vec = __m256;
using IVec = __m256i;
constexpr const char* kIsa = "avx2";
#endif
constexpr int64_t kBlockBytes = kTile * kBlock * 5 / 8;   // a tile's 5-bit codes of one 32-input block
#ifdef SCREEN_AVX512
constexpr int kMaxRows = 8;            // activation rows per register block (a pass over a tile's
                                       // weights; more rows per pass spill)
#else
constexpr int kMaxRows = 4;            // AVX2's 16 registers: 3 accumulators per row
constexpr int kPrefetchBytes = 4096;   // how far ahead of a block the stream is prefetched
#endif

// Rows in the register block starting at r0 when ``rows`` are split into as few blocks as
// possible, of sizes that differ by at most one: each block re-reads and re-unpacks the tile's
// weights, which costs about as much as 4 rows' products (9 rows as 5 + 4, not 8 + 1).
inline int block_rows(int64_t rows, int64_t r0) {
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t base = rows / blocks, extra = rows % blocks;   // the first `extra` blocks take one more
  const int64_t index = r0 <= extra * (base + 1) ? r0 / (base + 1) : extra + (r0 - extra * (base + 1)) / base;
  return static_cast<int>(index < extra ? base + 1 : base);
}

// The exact kernel's int16 activation rounding (gguf_kernel.cpp Int16Activations), split into two
// signed bytes, plus the per-block terms the screen needs. rows x k.
struct Activations {
  std::vector<int8_t> high, low;      // q = 256 high + low, low in [-128, 127]
  std::vector<float> dx8;             // 8 dx per block: the scale of u . q
  std::vector<float> offset_terms;    // dx_b * Q_b per block: c' = 8 u - 124.5 subtracts 124.5 of it
  std::vector<float> abs_terms;       // dx_b * A_b per block
  std::vector<uint8_t> is_finite;     // per row: every value finite (else its bounds mean nothing)
  int64_t k, nb;

  Activations(const float* x, int64_t rows, int64_t k_)
      : high(rows * k_), low(rows * k_), dx8(rows * (k_ / kBlock)), offset_terms(rows * (k_ / kBlock)),
        abs_terms(rows * (k_ / kBlock)), is_finite(rows, 1), k(k_), nb(k_ / kBlock) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) {
          amax = std::max(amax, std::fabs(xb[i]));
          if (!std::isfinite(xb[i])) is_finite[r] = 0;
        }
        const float d = amax / 32512.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* hb = high.data() + r * k + b * kBlock;
        int8_t* lb = low.data() + r * k + b * kBlock;
        int64_t sum = 0, abs_sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
          const int lo = static_cast<int8_t>(static_cast<uint8_t>(v & 0xFF));   // v mod 256 in [-128, 127]
          hb[i] = static_cast<int8_t>((v - lo) / 256);
          lb[i] = static_cast<int8_t>(lo);
          sum += v;
          abs_sum += v >= 0 ? v : -v;
        }
        dx8[r * nb + b] = 8.f * d;
        offset_terms[r * nb + b] = d * static_cast<float>(sum);
        abs_terms[r * nb + b] = d * static_cast<float>(abs_sum);
      }
    }
  }
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The float vector operations both builds share (SIMD(name): the build's intrinsic).
#ifdef SCREEN_AVX512
#define SIMD(name) _mm512_##name
#else
#define SIMD(name) _mm256_##name
#endif
inline Vec vset1(float v) { return SIMD(set1_ps)(v); }
inline Vec vzero() { return SIMD(setzero_ps)(); }
inline Vec vload(const float* p) { return SIMD(loadu_ps)(p); }
#ifdef SCREEN_AVX512
inline Vec vload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
inline Vec vload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline Vec vmul(Vec a, Vec b) { return SIMD(mul_ps)(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return SIMD(fmadd_ps)(a, b, c); }
inline Vec vfnmadd(Vec a, Vec b, Vec c) { return SIMD(fnmadd_ps)(a, b, c); }
inline Vec vcvt(IVec v) { return SIMD(cvtepi32_ps)(v); }

#ifdef SCREEN_AVX512
inline __mmask16 lane_mask(int valid) { return static_cast<__mmask16>((1u << valid) - 1); }
inline void store_valid(float* p, Vec v, int valid) { _mm512_mask_storeu_ps(p, lane_mask(valid), v); }
inline float max_valid(Vec v, int valid) { return _mm512_mask_reduce_max_ps(lane_mask(valid), v); }

// Appends the ids (from j0) and upper bounds of the valid lanes whose upper bound is >= lower.
inline int append_hits(Vec upper, float lower, int valid, int32_t j0, int32_t* ids, float* ups) {
  const __mmask16 hit = _mm512_mask_cmp_ps_mask(lane_mask(valid), upper, _mm512_set1_ps(lower), _CMP_GE_OQ);
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(j0),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_mask_compressstoreu_epi32(ids, hit, index);
  _mm512_mask_compressstoreu_ps(ups, hit, upper);
  return __builtin_popcount(hit);
}

// One tile's block (16 rows x 32 inputs, 320 bytes at p, inputs from i0) against ROWS activation
// rows: dot[r] = u . q per vocabulary row, exact int32.
template <int ROWS>
void block_dots(const int8_t* const* xh, const int8_t* const* xl, const uint8_t* p, int64_t i0, IVec* dot) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i one = _mm512_set1_epi8(1);
  __m512i ah[ROWS], al[ROWS];
  for (int r = 0; r < ROWS; ++r) ah[r] = al[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < kBlock / 8; ++g) {
    const uint8_t* pg = p + g * 80;
    const __m512i packed = _mm512_loadu_si512(pg);
    uint64_t bits[2];
    std::memcpy(bits, pg + 64, 16);
    for (int half = 0; half < 2; ++half) {
      const __m512i h = _mm512_and_si512(half == 0 ? packed : _mm512_srli_epi16(packed, 4), nibble);
      const __m512i twice = _mm512_add_epi8(h, h);
      const __m512i u = _mm512_mask_add_epi8(twice, static_cast<__mmask64>(bits[half]), twice, one);
      const int64_t i = i0 + g * 8 + 4 * half;
      for (int r = 0; r < ROWS; ++r) {
        ah[r] = _mm512_dpbusd_epi32(ah[r], u, _mm512_set1_epi32(load4(xh[r] + i)));
        al[r] = _mm512_dpbusd_epi32(al[r], u, _mm512_set1_epi32(load4(xl[r] + i)));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]);
}

// Packs one tile's block (``rows`` valid vocabulary rows from c, row stride k, inputs from i0) into
// out (kBlockBytes, zeroed).
void pack_block(const int8_t* c, int64_t k, int64_t rows, int64_t i0, uint8_t* out) {
  for (int64_t g = 0; g < kBlock / 8; ++g) {
    uint8_t* os = out + g * 80;
    uint64_t bits[2] = {0, 0};
    for (int64_t r = 0; r < rows; ++r) {
      for (int half = 0; half < 2; ++half) {
        for (int j = 0; j < 4; ++j) {
          const int u = (static_cast<int>(c[r * k + i0 + g * 8 + 4 * half + j]) >> 3) + 16;   // floor(c / 8) + 16
          const int lane = static_cast<int>(4 * r + j);
          os[lane] = static_cast<uint8_t>(os[lane] | (((u >> 1) & 0x0F) << (4 * half)));
          if (u & 1) bits[half] |= (uint64_t{1} << lane);
        }
      }
    }
    std::memcpy(os + 64, bits, 16);
  }
}
#else
inline void store_valid(float* p, Vec v, int valid) {
  if (valid == kTile) {
    _mm256_storeu_ps(p, v);
    return;
  }
  alignas(32) float lanes[kTile];
  _mm256_store_ps(lanes, v);
  std::memcpy(p, lanes, valid * sizeof(float));
}

inline float max_valid(Vec v, int valid) {
  if (valid == kTile) {   // every tile but the last: a tree of maxima (max is exact: any order, the same value)
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
  }
  alignas(32) float lanes[kTile];
  _mm256_store_ps(lanes, v);
  float best = lanes[0];
  for (int i = 1; i < valid; ++i) best = std::max(best, lanes[i]);
  return best;
}

inline int append_hits(Vec upper, float lower, int valid, int32_t j0, int32_t* ids, float* ups) {
  unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(upper, _mm256_set1_ps(lower), _CMP_GE_OQ)))
                 & ((1u << valid) - 1);
  if (hit == 0) return 0;
  alignas(32) float lanes[kTile];
  _mm256_store_ps(lanes, upper);
  int count = 0;
  for (; hit != 0; hit &= hit - 1, ++count) {
    const int lane = __builtin_ctz(hit);
    ids[count] = j0 + lane;
    ups[count] = lanes[lane];
  }
  return count;
}

// Inlined into screen_tile's loop over blocks: its constants are then set once per tile, not per block.
template <int ROWS>
__attribute__((always_inline)) inline void block_dots(const int8_t* const* xh, const int8_t* const* xl,
                                                      const uint8_t* p, int64_t i0, IVec* dot) {
  const __m256i low5 = _mm256_set1_epi8(0x1F), top3 = _mm256_set1_epi8(0x1C), low2 = _mm256_set1_epi8(0x03);
  const __m256i by256 = _mm256_set1_epi16(256), by1 = _mm256_set1_epi16(1);
  for (int line = 0; line < kBlockBytes; line += 64)   // the stream ahead (as the block kernel's)
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + line, _MM_HINT_T0);
  const __m256i twos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128));
  for (int r = 0; r < ROWS; ++r) dot[r] = _mm256_setzero_si256();
  for (int half = 0; half < 2; ++half) {   // 16 inputs: 4 steps of 4, summed exactly in int16
    __m256i sh[ROWS], sl[ROWS];
    for (int r = 0; r < ROWS; ++r) sh[r] = sl[r] = _mm256_setzero_si256();
    for (int m = 0; m < 4; ++m) {
      const int step = 4 * half + m;
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * m));   // (an array of
      // the 4 planes went through the stack in 16-byte halves: store-forwarding stalls)
      // step m: a byte's low 5 bits; step 4 + m: its top 3 (to bits 2-4) and 2 bits of the last plane
      const __m256i u = half == 0 ? _mm256_and_si256(plane, low5)
                                  : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(plane, 3), top3),
                                                    _mm256_and_si256(_mm256_srli_epi16(twos, 2 * m), low2));
      const int64_t i = i0 + 4 * step;
      for (int r = 0; r < ROWS; ++r) {
        sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(u, _mm256_set1_epi32(load4(xh[r] + i))));
        sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(u, _mm256_set1_epi32(load4(xl[r] + i))));
      }
    }
    for (int r = 0; r < ROWS; ++r)
      dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(_mm256_madd_epi16(sh[r], by256),
                                                         _mm256_madd_epi16(sl[r], by1)));
  }
}

void pack_block(const int8_t* c, int64_t k, int64_t rows, int64_t i0, uint8_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < kBlock; ++i) {
      const int u = (static_cast<int>(c[r * k + i0 + i]) >> 3) + 16;   // floor(c / 8) + 16
      const int step = i / 4, lane = static_cast<int>(4 * r + i % 4);
      if (step < 4) {
        out[32 * step + lane] = static_cast<uint8_t>(out[32 * step + lane] | u);
      } else {
        uint8_t& plane = out[32 * (step - 4) + lane];
        plane = static_cast<uint8_t>(plane | ((u >> 2) << 5));
        out[128 + lane] = static_cast<uint8_t>(out[128 + lane] | ((u & 3) << (2 * (step - 4))));
      }
    }
  }
}
#endif

// ROWS activation rows (from r0) against one tile of kTile vocabulary rows: s[r] = S, d[r] = D of
// the tile's rows (see the top). ``Scale``: float (float32 scales) or uint16_t (fp16 bits).
template <int ROWS, class Scale>
void screen_tile(const Activations& acts, const uint8_t* w, const void* scales, int64_t r0, Vec* s_out, Vec* d_out) {
  const int64_t k = acts.k, nb = acts.nb;
  const Scale* ws = static_cast<const Scale*>(scales);
  Vec s[ROWS];
  const int8_t* xh[ROWS];
  const int8_t* xl[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    s[r] = vzero();
    xh[r] = acts.high.data() + (r0 + r) * k;
    xl[r] = acts.low.data() + (r0 + r) * k;
  }
  IVec dot[ROWS];
  for (int64_t b = 0; b < nb; ++b) {
    block_dots<ROWS>(xh, xl, w + b * kBlockBytes, b * kBlock, dot);
    const Vec scale = vload(ws + b * kTile);
    for (int r = 0; r < ROWS; ++r)
      s[r] = vfmadd(vmul(vcvt(dot[r]), vset1(acts.dx8[(r0 + r) * nb + b])), scale, s[r]);
  }
  for (int r = 0; r < ROWS; ++r) {
    Vec offset = vzero(), bound = vzero();
    const float* ot = acts.offset_terms.data() + (r0 + r) * nb;
    const float* at = acts.abs_terms.data() + (r0 + r) * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const Vec scale = vload(ws + b * kTile);
      offset = vfmadd(scale, vset1(ot[b]), offset);
      bound = vfmadd(scale, vset1(at[b]), bound);
    }
    s_out[r] = vfnmadd(vset1(124.5f), offset, s[r]);
    d_out[r] = bound;
  }
}

using TileFn = void (*)(const Activations&, const uint8_t*, const void*, int64_t, Vec*, Vec*);
template <class Scale>
struct TileFns {
  static constexpr TileFn kFns[8] = {screen_tile<1, Scale>, screen_tile<2, Scale>, screen_tile<3, Scale>,
                                     screen_tile<4, Scale>, screen_tile<5, Scale>, screen_tile<6, Scale>,
                                     screen_tile<7, Scale>, screen_tile<8, Scale>};
};
static_assert(kMaxRows <= 8, "a tile function per register block size");

// The tiled scales as the tile functions take them: the functions for their dtype, their bytes and
// the bytes of one tile's scales.
struct TiledScales {
  const TileFn* fns;
  const uint8_t* base;
  int64_t tile_bytes;

  TiledScales(const torch::Tensor& scales, int64_t nb) {
    const bool half = scales.dtype() == torch::kFloat16;
    fns = half ? TileFns<uint16_t>::kFns : TileFns<float>::kFns;
    base = static_cast<const uint8_t*>(scales.data_ptr());
    tile_bytes = nb * kTile * (half ? 2 : 4);
  }
  void tile(int rows, const Activations& acts, const uint8_t* w, int64_t t, int64_t r0, Vec* s, Vec* d) const {
    fns[rows - 1](acts, w, base + t * tile_bytes, r0, s, d);
  }
};

void check_inputs(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t k = x.size(1), tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kBlock == 0 && packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2
              && packed.size(0) == tiles && packed.size(1) == k / kBlock * kBlockBytes,
              "packed: uint8 [ceil(N / TILE), K / 32 * TILE * 20] (pack_screen, TILE = ", kTile, ")");
  TORCH_CHECK((scales.dtype() == torch::kFloat32 || scales.dtype() == torch::kFloat16) && scales.is_contiguous()
              && scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == k / kBlock && scales.size(2) == kTile,
              "scales: float32 or float16 [ceil(N / TILE), K / 32, TILE] (pack_scales, TILE = ", kTile, ")");
}

inline int valid_rows(int64_t n, int64_t j0) { return static_cast<int>(std::min<int64_t>(kTile, n - j0)); }

// S and D [M, N] of every vocabulary row, parallel over tiles.
void screen_all(const Activations& acts, int64_t rows, const uint8_t* w, const TiledScales& sc, int64_t n,
                float* so, float* dout) {
  const int64_t tiles = (n + kTile - 1) / kTile, k = acts.k;
  const int64_t tile_bytes = k / kBlock * kBlockBytes;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    Vec s[kMaxRows], d[kMaxRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTile;
      const int valid = valid_rows(n, j0);
      for (int64_t r0 = 0, block = 0; r0 < rows; r0 += block) {
        block = block_rows(rows, r0);
        sc.tile(static_cast<int>(block), acts, w + t * tile_bytes, t, r0, s, d);
        for (int r = 0; r < block; ++r) {
          store_valid(so + (r0 + r) * n + j0, s[r], valid);
          store_valid(dout + (r0 + r) * n + j0, d[r], valid);
        }
      }
    }
  });
}

}  // namespace

// Packs Q8_0 codes [N, K] (int8, |c| <= 127) into the screen's [ceil(N / TILE), K / 32 * TILE * 20] uint8 tiles.
torch::Tensor pack_screen(torch::Tensor codes) {
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const int64_t tile_bytes = k / kBlock * kBlockBytes;
  auto out = torch::zeros({tiles, tile_bytes}, codes.options().dtype(torch::kUInt8));
  const int8_t* c = codes.data_ptr<int8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < k / kBlock; ++b)
        pack_block(c + t * kTile * k, k, valid_rows(n, t * kTile), b * kBlock, o + t * tile_bytes + b * kBlockBytes);
  });
  return out;
}

// Q8_0 scales [N, K / 32] float32 or float16 -> the screen's tiled copy [ceil(N / TILE), K / 32, TILE]
// in their dtype (zero padded).
torch::Tensor pack_scales(torch::Tensor scales) {
  TORCH_CHECK((scales.dtype() == torch::kFloat32 || scales.dtype() == torch::kFloat16) && scales.dim() == 2,
              "scales: float32 or float16 [N, K / 32]");
  const int64_t n = scales.size(0), tiles = (n + kTile - 1) / kTile;
  auto padded = torch::zeros({tiles * kTile, scales.size(1)}, scales.options());
  padded.narrow(0, 0, n).copy_(scales);
  return padded.view({tiles, kTile, scales.size(1)}).transpose(1, 2).contiguous();
}

// x [M, K] float32, packed and scales from pack_screen / pack_scales of an N-row head
// -> (S [M, N], D [M, N]).
std::vector<torch::Tensor> screen_logits(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n) {
  check_inputs(x, packed, scales, n);
  const int64_t rows = x.size(0), k = x.size(1);
  auto s_out = torch::empty({rows, n}, x.options());
  auto d_out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return {s_out, d_out};
  const Activations acts(x.data_ptr<float>(), rows, k);
  screen_all(acts, rows, packed.data_ptr<uint8_t>(), TiledScales(scales, acts.nb), n, s_out.data_ptr<float>(),
             d_out.data_ptr<float>());
  return {s_out, d_out};
}

// The candidates of each row of x: the vocabulary rows whose upper bound S + e D reaches the
// largest lower bound S - e D (e = code_error: 3.5 plus the rounding margin), ascending. Returns
// [counts (int64 [M]), then per row its ids (int64), empty where the count exceeds max_candidates].
// A row of x with a value that is not finite has no bound: count 0, no ids (the caller's full head).
//
// One pass, S and D never stored: each chunk of tiles keeps per row the largest lower bound so
// far and the ids (with their upper bounds) that reach it; a row passed over there has an upper
// bound below some lower bound, so it is below the final one too. The final largest lower bound
// then filters the kept ids: the same set, the same roundings (one fma, one fnmadd) as comparing
// every row's bounds after the fact.
std::vector<torch::Tensor> screen_candidates(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                             int64_t n, double code_error, int64_t max_candidates) {
  check_inputs(x, packed, scales, n);
  const int64_t rows = x.size(0), k = x.size(1), tiles = (n + kTile - 1) / kTile;
  auto counts = torch::zeros({rows}, torch::kInt64);
  std::vector<torch::Tensor> out(rows + 1);
  out[0] = counts;
  if (rows == 0) return out;
  const Activations acts(x.data_ptr<float>(), rows, k);
  const float e = static_cast<float>(code_error);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const TiledScales sc(scales, acts.nb);
  const int64_t tile_bytes = k / kBlock * kBlockBytes;
  struct Chunk {
    int64_t begin;
    std::vector<float> lower;                  // per row: the largest lower bound in the chunk
    std::vector<std::vector<int32_t>> ids;     // per row: ids whose upper bound reached it then
    std::vector<std::vector<float>> upper;
  };
  std::vector<Chunk> chunks;
  std::mutex chunks_mutex;
  const int64_t grain = std::max<int64_t>(64, tiles / (4 * at::get_num_threads()) + 1);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    Chunk chunk{begin, std::vector<float>(rows, -INFINITY), std::vector<std::vector<int32_t>>(rows),
                std::vector<std::vector<float>>(rows)};
    for (auto& v : chunk.ids) v.resize(16 * 64);
    for (auto& v : chunk.upper) v.resize(16 * 64);
    std::vector<int64_t> used(rows, 0);
    const Vec ev = vset1(e);
    Vec s[kMaxRows], d[kMaxRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTile;
      const int valid = valid_rows(n, j0);
      for (int64_t r0 = 0, block = 0; r0 < rows; r0 += block) {
        block = block_rows(rows, r0);
        sc.tile(static_cast<int>(block), acts, w + t * tile_bytes, t, r0, s, d);
        for (int i = 0; i < block; ++i) {
          const int64_t r = r0 + i;
          const float tile_max = max_valid(vfnmadd(ev, d[i], s[i]), valid);
          if (tile_max > chunk.lower[r]) chunk.lower[r] = tile_max;
          auto& ids = chunk.ids[r];
          auto& ups = chunk.upper[r];
          if (used[r] + kTile > static_cast<int64_t>(ids.size())) {
            ids.resize(ids.size() * 2);
            ups.resize(ups.size() * 2);
          }
          used[r] += append_hits(vfmadd(ev, d[i], s[i]), chunk.lower[r], valid, static_cast<int32_t>(j0),
                                 ids.data() + used[r], ups.data() + used[r]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      chunk.ids[r].resize(used[r]);
      chunk.upper[r].resize(used[r]);
    }
    std::lock_guard<std::mutex> lock(chunks_mutex);
    chunks.push_back(std::move(chunk));
  });
  std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
  int64_t* count_out = counts.data_ptr<int64_t>();
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < rows; ++r) {
    float lower = -INFINITY;
    for (const Chunk& chunk : chunks) lower = std::max(lower, chunk.lower[r]);
    ids.clear();
    for (const Chunk& chunk : chunks)
      for (size_t i = 0; i < chunk.ids[r].size(); ++i)
        if (chunk.upper[r][i] >= lower) ids.push_back(chunk.ids[r][i]);
    if (!acts.is_finite[r]) ids.clear();
    const int64_t count = static_cast<int64_t>(ids.size());
    count_out[r] = count;
    auto row_ids = torch::empty({count > max_candidates ? 0 : count}, torch::kInt64);
    int64_t* o = row_ids.data_ptr<int64_t>();
    if (count <= max_candidates)
      for (int64_t i = 0; i < count; ++i) o[i] = ids[i];
    out[r + 1] = row_ids;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("screen_candidates", &screen_candidates, "(counts [M], then each row's candidate ids)");
  m.def("pack_screen", &pack_screen, "Q8_0 codes [N, K] int8 -> the screen's packed 5-bit tiles");
  m.def("pack_scales", &pack_scales, "Q8_0 scales [N, K / 32] -> the screen's tiled copy");
  m.def("screen_logits", &screen_logits, "(approximate logits S, bound factor D) of every row, [M, N] each");
  m.attr("ISA") = kIsa;
  m.attr("TILE") = kTile;
}
