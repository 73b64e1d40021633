// Greedy LM-head screen (servelm/model/layers/lm_head_screen.py): approximate logits of every
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
// The scales are copied tiled too ([tiles, K / 32, 16] float32), one vector per tile and block.
//
// Activations are rounded exactly as the exact int16 kernel (gguf_kernel.cpp, Int16Activations)
// rounds them: q = round(x / dx), dx = amax / 32512 per 32 inputs (the same code, the same IEEE
// float operations, so the same q and dx), split q = 256 hi + lo with hi, lo signed bytes (the
// integer product u . q is exact either way). With Q = sum over a block of q and A = sum of |q|:
//   exact  T = sum_b d_b dx_b (c_b . q_b)
//   screen S = sum_b d_b dx_b (8 u_b . q_b - 124.5 Q_b)           (c' = 8 u - 124.5)
//   |T - S| <= 3.5 sum_b d_b dx_b A_b = 3.5 D
// The kernel returns S and D per row; the caller adds a float-rounding margin proportional to D.
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
constexpr int64_t kTile = 16;          // vocabulary rows per tile (one 32-bit lane each)
constexpr int64_t kGroup = 8;          // inputs per packed group
constexpr int64_t kGroupBytes = 80;    // 64 nibble bytes + two 8-byte bit masks
constexpr int kMaxRows = 8;            // activation rows per register block (a pass over a tile's
                                       // weights; more rows per pass spill)

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
  int64_t k, nb;

  Activations(const float* x, int64_t rows, int64_t k_)
      : high(rows * k_), low(rows * k_), dx8(rows * (k_ / kBlock)), offset_terms(rows * (k_ / kBlock)),
        abs_terms(rows * (k_ / kBlock)), k(k_), nb(k_ / kBlock) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
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

// ROWS activation rows (from r0) against one tile of 16 vocabulary rows: s[r] = S, d[r] = D of
// the tile's rows (see the top).
template <int ROWS>
void screen_tile(const Activations& acts, const uint8_t* w, const float* ws, int64_t r0, __m512* s_out,
                 __m512* d_out) {
  const int64_t k = acts.k, nb = acts.nb;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i one = _mm512_set1_epi8(1);
  __m512 s[ROWS];
  const int8_t* xh[ROWS];
  const int8_t* xl[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    s[r] = _mm512_setzero_ps();
    xh[r] = acts.high.data() + (r0 + r) * k;
    xl[r] = acts.low.data() + (r0 + r) * k;
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ah[ROWS], al[ROWS];
    for (int r = 0; r < ROWS; ++r) ah[r] = al[r] = _mm512_setzero_si512();
    for (int64_t g = 0; g < kBlock / kGroup; ++g) {
      const uint8_t* p = w + (b * (kBlock / kGroup) + g) * kGroupBytes;
      const __m512i packed = _mm512_loadu_si512(p);
      uint64_t bits[2];
      std::memcpy(bits, p + 64, 16);
      const int64_t i0 = b * kBlock + g * kGroup;
      for (int half = 0; half < 2; ++half) {
        const __m512i h = _mm512_and_si512(half == 0 ? packed : _mm512_srli_epi16(packed, 4), nibble);
        const __m512i twice = _mm512_add_epi8(h, h);
        const __m512i u = _mm512_mask_add_epi8(twice, static_cast<__mmask64>(bits[half]), twice, one);
        const int64_t i = i0 + 4 * half;
        for (int r = 0; r < ROWS; ++r) {
          ah[r] = _mm512_dpbusd_epi32(ah[r], u, _mm512_set1_epi32(load4(xh[r] + i)));
          al[r] = _mm512_dpbusd_epi32(al[r], u, _mm512_set1_epi32(load4(xl[r] + i)));
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(ws + b * kTile);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]);   // u . q, exact
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(acts.dx8[(r0 + r) * nb + b]));
      s[r] = _mm512_fmadd_ps(t, scale, s[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    __m512 offset = _mm512_setzero_ps(), bound = _mm512_setzero_ps();
    const float* ot = acts.offset_terms.data() + (r0 + r) * nb;
    const float* at = acts.abs_terms.data() + (r0 + r) * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 scale = _mm512_loadu_ps(ws + b * kTile);
      offset = _mm512_fmadd_ps(scale, _mm512_set1_ps(ot[b]), offset);
      bound = _mm512_fmadd_ps(scale, _mm512_set1_ps(at[b]), bound);
    }
    s_out[r] = _mm512_fnmadd_ps(_mm512_set1_ps(124.5f), offset, s[r]);
    d_out[r] = bound;
  }
}

using TileFn = void (*)(const Activations&, const uint8_t*, const float*, int64_t, __m512*, __m512*);
constexpr TileFn kTileFns[kMaxRows] = {screen_tile<1>, screen_tile<2>, screen_tile<3>, screen_tile<4>,
                                        screen_tile<5>, screen_tile<6>, screen_tile<7>, screen_tile<8>};

void check_inputs(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t k = x.size(1), tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kBlock == 0 && packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2
              && packed.size(0) == tiles && packed.size(1) == k / kGroup * kGroupBytes,
              "packed: uint8 [ceil(N / 16), K / 8 * 80] (pack_screen)");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 3
              && scales.size(0) == tiles && scales.size(1) == k / kBlock && scales.size(2) == kTile,
              "scales: float32 [ceil(N / 16), K / 32, 16] (pack_scales)");
}

// S and D [M, N] of every vocabulary row, parallel over tiles.
void screen_all(const Activations& acts, int64_t rows, const uint8_t* w, const float* sc, int64_t n,
                float* so, float* dout) {
  const int64_t tiles = (n + kTile - 1) / kTile, k = acts.k;
  const int64_t tile_bytes = k / kGroup * kGroupBytes, tile_scales = acts.nb * kTile;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    __m512 s[kMaxRows], d[kMaxRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTile;
      const __mmask16 valid = n - j0 >= kTile ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (n - j0)) - 1);
      for (int64_t r0 = 0, block = 0; r0 < rows; r0 += block) {
        block = block_rows(rows, r0);
        kTileFns[block - 1](acts, w + t * tile_bytes, sc + t * tile_scales, r0, s, d);
        for (int r = 0; r < block; ++r) {
          _mm512_mask_storeu_ps(so + (r0 + r) * n + j0, valid, s[r]);
          _mm512_mask_storeu_ps(dout + (r0 + r) * n + j0, valid, d[r]);
        }
      }
    }
  });
}

}  // namespace

// Packs Q8_0 codes [N, K] (int8, |c| <= 127) into the screen's [ceil(N / 16), K / 8 * 80] uint8 tiles.
torch::Tensor pack_screen(torch::Tensor codes) {
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const int64_t tile_bytes = k / kGroup * kGroupBytes;
  auto out = torch::zeros({tiles, tile_bytes}, codes.options().dtype(torch::kUInt8));
  const int8_t* c = codes.data_ptr<int8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < k / kGroup; ++g) {
        uint8_t* os = o + t * tile_bytes + g * kGroupBytes;
        uint64_t bits[2] = {0, 0};
        for (int64_t r = 0; r < kTile && t * kTile + r < n; ++r) {
          const int8_t* cs = c + (t * kTile + r) * k + g * kGroup;
          for (int half = 0; half < 2; ++half) {
            for (int j = 0; j < 4; ++j) {
              const int u = (static_cast<int>(cs[4 * half + j]) >> 3) + 16;   // arithmetic shift: floor(c / 8)
              const int lane = static_cast<int>(4 * r + j);
              os[lane] = static_cast<uint8_t>(os[lane] | (((u >> 1) & 0x0F) << (4 * half)));
              if (u & 1) bits[half] |= (uint64_t{1} << lane);
            }
          }
        }
        std::memcpy(os + 64, bits, 16);
      }
    }
  });
  return out;
}

// Q8_0 scales [N, K / 32] float32 -> the screen's tiled copy [ceil(N / 16), K / 32, 16] (zero padded).
torch::Tensor pack_scales(torch::Tensor scales) {
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.dim() == 2, "scales: float32 [N, K / 32]");
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
  screen_all(acts, rows, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, s_out.data_ptr<float>(),
             d_out.data_ptr<float>());
  return {s_out, d_out};
}

// The candidates of each row of x: the vocabulary rows whose upper bound S + e D reaches the
// largest lower bound S - e D (e = code_error: 3.5 plus the rounding margin), ascending. Returns
// [counts (int64 [M]), then per row its ids (int64), empty where the count exceeds max_candidates].
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
  const float* sc = scales.data_ptr<float>();
  const int64_t tile_bytes = k / kGroup * kGroupBytes, tile_scales = acts.nb * kTile;
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
    const __m512 ev = _mm512_set1_ps(e);
    __m512 s[kMaxRows], d[kMaxRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTile;
      const __mmask16 valid = n - j0 >= kTile ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (n - j0)) - 1);
      const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for (int64_t r0 = 0, block = 0; r0 < rows; r0 += block) {
        block = block_rows(rows, r0);
        kTileFns[block - 1](acts, w + t * tile_bytes, sc + t * tile_scales, r0, s, d);
        for (int i = 0; i < block; ++i) {
          const int64_t r = r0 + i;
          const __m512 lower = _mm512_fnmadd_ps(ev, d[i], s[i]);
          const float tile_max = _mm512_mask_reduce_max_ps(valid, lower);
          if (tile_max > chunk.lower[r]) chunk.lower[r] = tile_max;
          const __m512 upper = _mm512_fmadd_ps(ev, d[i], s[i]);
          const __mmask16 hit = _mm512_mask_cmp_ps_mask(valid, upper, _mm512_set1_ps(chunk.lower[r]), _CMP_GE_OQ);
          if (hit) {
            auto& ids = chunk.ids[r];
            auto& ups = chunk.upper[r];
            if (used[r] + 16 > static_cast<int64_t>(ids.size())) {
              ids.resize(ids.size() * 2);
              ups.resize(ups.size() * 2);
            }
            _mm512_mask_compressstoreu_epi32(ids.data() + used[r], hit, index);
            _mm512_mask_compressstoreu_ps(ups.data() + used[r], hit, upper);
            used[r] += __builtin_popcount(hit);
          }
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
}
