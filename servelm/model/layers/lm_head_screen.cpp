// Greedy LM-head screen (servelm/model/layers/lm_head_screen.py): approximate logits of every
// vocabulary row from the top 5 bits of its Q8_0 codes, with a rigorous per-row error bound.
//
// A Q8_0 row is codes c (int8 in [-127, 127]) with one float scale d per 32 inputs. The screen
// keeps s = c >> 3 (floor(c / 8), in [-16, 15]) as u = s + 16 in [0, 31]: 5 bits per weight, packed
// per 128 inputs as 64 bytes of u >> 1 (low nibble: input j, high nibble: input j + 64; one 512-bit
// load serves two steps) followed by 16 bytes holding u & 1 as bit masks (bit j of the first 8:
// input j; of the next 8: input 64 + j): 80 bytes per 128 inputs. The screen's code
// is the middle of the 8 codes that share s: c' = 8 s + 3.5, so |c - c'| <= 3.5.
//
// Activations are rounded exactly as the exact int16 kernel (gguf_kernel.cpp, Int16Activations)
// rounds them: q = round(x / dx), dx = amax / 32512 per 32 inputs (the same code, the same IEEE
// float operations, so the same q and dx). With Q = sum over a block of q and A = sum of |q|:
//   exact  T = sum_b d_b dx_b (c_b . q_b)
//   screen S = sum_b d_b dx_b (8 u_b . q_b - 124.5 Q_b)           (c' = 8 u - 124.5)
//   |T - S| <= 3.5 sum_b d_b dx_b A_b = 3.5 D
// The kernel returns S and D per row; the caller adds a float-rounding margin proportional to D.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kStep = 64;          // inputs per 512-bit step
constexpr int64_t kPair = 128;         // inputs per packed group (two steps)
constexpr int64_t kPairBytes = 80;     // packed bytes per group: 64 nibble bytes + 16 bit-mask bytes

// The exact kernel's int16 activation rounding (gguf_kernel.cpp Int16Activations), plus the
// per-block sums the screen needs. rows x k.
struct Activations {
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  std::vector<float> lane_scales;   // 8 dx per 4 inputs (16 lanes per step): the scale of u . q
  std::vector<float> offset_terms;  // dx_b * Q_b per block: c' = 8 u - 124.5 subtracts 124.5 of it
  std::vector<float> abs_terms;     // dx_b * A_b per block
  int64_t k;

  Activations(const float* x, int64_t rows, int64_t k_)
      : high(rows * k_), low(rows * k_), lane_scales(rows * (k_ / 4)), offset_terms(rows * (k_ / kBlock)),
        abs_terms(rows * (k_ / kBlock)), k(k_) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const float* xb = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 32512.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* hb = high.data() + r * k + b * kBlock;
        uint8_t* lb = low.data() + r * k + b * kBlock;
        int64_t sum = 0, abs_sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
          const int hi = v >= 0 ? v / 256 : -((-v + 255) / 256);   // floor(v / 256)
          hb[i] = static_cast<int8_t>(hi);
          lb[i] = static_cast<uint8_t>(v - hi * 256);
          sum += v;
          abs_sum += v >= 0 ? v : -v;
        }
        float* lanes = lane_scales.data() + r * (k / 4) + b * (kBlock / 4);
        for (int i = 0; i < kBlock / 4; ++i) lanes[i] = 8.f * d;
        offset_terms[r * (k / kBlock) + b] = d * static_cast<float>(sum);
        abs_terms[r * (k / kBlock) + b] = d * static_cast<float>(abs_sum);
      }
    }
  }
};

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

// ROWS activation rows against one packed weight row: out_s[r] = S, out_d[r] = D (see the top).
// One 64-input step of ROWS activation rows against weight codes u (unsigned, [0, 31]) with block
// scales ws: acc += 8 dx ws (u . q), q = 256 hi + lo (u unsigned against signed hi, and u < 128
// signed against unsigned lo, as the exact kernel does with w).
template <int ROWS>
inline void screen_step(const __m512i u, const __m512 ws, const int8_t* const* xh, const uint8_t* const* xl,
                        const float* const* xs, int64_t c, __m512* acc) {
  const __m512i zero = _mm512_setzero_si512();
  for (int r = 0; r < ROWS; ++r) {
    const __m512i dh = _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512(xh[r] + c * kStep));
    const __m512i d = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), _mm512_loadu_si512(xl[r] + c * kStep), u);
    const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xs[r] + c * 16));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
  }
}

// ROWS activation rows against one packed weight row: out_s[r] = S, out_d[r] = D (see the top).
template <int ROWS>
void screen_dot(const Activations& acts, const uint8_t* w, const float* w_scales, int64_t r0,
                float* out_s, float* out_d) {
  const int64_t k = acts.k, nb = k / kBlock, pairs = k / kPair;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i scale_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int8_t* xh[ROWS];
  const uint8_t* xl[ROWS];
  const float* xs[ROWS];
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    xh[r] = acts.high.data() + (r0 + r) * k;
    xl[r] = acts.low.data() + (r0 + r) * k;
    xs[r] = acts.lane_scales.data() + (r0 + r) * (k / 4);
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < pairs; ++g) {
    const uint8_t* p = w + g * kPairBytes;
    const __m512i packed = _mm512_loadu_si512(p);
    uint64_t bits[2];
    std::memcpy(bits, p + 64, 16);
    for (int half = 0; half < 2; ++half) {
      const __m512i h = _mm512_and_si512(half == 0 ? packed : _mm512_srli_epi16(packed, 4), nibble);
      const __m512i twice = _mm512_add_epi8(h, h);
      const __m512i u = _mm512_mask_add_epi8(twice, static_cast<__mmask64>(bits[half]), twice, one);
      const int64_t c = 2 * g + half;
      const __m512 ws = _mm512_permutexvar_ps(scale_index, _mm512_castps128_ps512(_mm_maskz_loadu_ps(0x3, w_scales + c * 2)));
      screen_step<ROWS>(u, ws, xh, xl, xs, c, acc);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const int64_t row = r0 + r;
    out_s[r] = _mm512_reduce_add_ps(acc[r]) - 124.5f * dot_f32(w_scales, acts.offset_terms.data() + row * nb, nb);
    out_d[r] = dot_f32(w_scales, acts.abs_terms.data() + row * nb, nb);
  }
}

}  // namespace

// Packs Q8_0 codes [N, K] (int8, |c| <= 127) into the screen's [N, K / 64 * 40] uint8 layout.
torch::Tensor pack_screen(torch::Tensor codes) {
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kPair == 0, "K must be a multiple of 128");
  auto out = torch::zeros({n, k / kPair * kPairBytes}, codes.options().dtype(torch::kUInt8));
  const int8_t* c = codes.data_ptr<int8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t g = 0; g < k / kPair; ++g) {
        const int8_t* cs = c + row * k + g * kPair;
        uint8_t* os = o + row * (k / kPair * kPairBytes) + g * kPairBytes;
        uint64_t bits[2] = {0, 0};
        for (int j = 0; j < kPair; ++j) {
          const int u = (static_cast<int>(cs[j]) >> 3) + 16;   // arithmetic shift: floor(c / 8)
          const int half = j / kStep, lane = j % kStep;
          os[lane] = static_cast<uint8_t>(os[lane] | (((u >> 1) & 0x0F) << (4 * half)));
          if (u & 1) bits[half] |= (uint64_t{1} << lane);
        }
        std::memcpy(os + kStep, bits, 16);
      }
    }
  });
  return out;
}

// x [M, K] float32, packed [N, K / 64 * 40], scales [N, K / 32] -> (S [M, N], D [M, N]).
std::vector<torch::Tensor> screen_logits(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(k % kPair == 0 && packed.dtype() == torch::kUInt8 && packed.is_contiguous()
              && packed.size(1) == k / kPair * kPairBytes, "packed: uint8 [N, K / 128 * 80]");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == n
              && scales.size(1) == k / kBlock, "scales: float32 [N, K / 32]");
  auto s_out = torch::empty({rows, n}, x.options());
  auto d_out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return {s_out, d_out};
  const Activations acts(x.data_ptr<float>(), rows, k);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  float* so = s_out.data_ptr<float>();
  float* dout = d_out.data_ptr<float>();
  const int64_t row_bytes = k / kPair * kPairBytes, nb = k / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float s_tile[4], d_tile[4];
    for (int64_t n0 = begin; n0 < end; n0 += 32) {
      const int64_t n1 = std::min(end, n0 + 32);
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int tile = static_cast<int>(std::min<int64_t>(4, rows - r0));
        for (int64_t j = n0; j < n1; ++j) {
          const uint8_t* wr = w + j * row_bytes;
          const float* sr = sc + j * nb;
          switch (tile) {
            case 4: screen_dot<4>(acts, wr, sr, r0, s_tile, d_tile); break;
            case 3: screen_dot<3>(acts, wr, sr, r0, s_tile, d_tile); break;
            case 2: screen_dot<2>(acts, wr, sr, r0, s_tile, d_tile); break;
            default: screen_dot<1>(acts, wr, sr, r0, s_tile, d_tile); break;
          }
          for (int t = 0; t < tile; ++t) {
            so[(r0 + t) * n + j] = s_tile[t];
            dout[(r0 + t) * n + j] = d_tile[t];
          }
        }
      }
    }
  });
  return {s_out, d_out};
}

// The candidates of each row of x: the vocabulary rows whose upper bound S + e D reaches the
// largest lower bound S - e D (e = code_error: 3.5 plus the rounding margin), ascending. Returns
// [counts (int64 [M]), then per row its ids (int64), empty where the count exceeds max_candidates].
std::vector<torch::Tensor> screen_candidates(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                             double code_error, int64_t max_candidates) {
  const std::vector<torch::Tensor> sd = screen_logits(x, packed, scales);
  const int64_t rows = x.size(0), n = packed.size(0);
  const float e = static_cast<float>(code_error);
  auto counts = torch::zeros({rows}, torch::kInt64);
  std::vector<torch::Tensor> out{counts};
  std::vector<int32_t> ids(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sd[0].data_ptr<float>() + r * n;
    const float* d = sd[1].data_ptr<float>() + r * n;
    const __m512 ev = _mm512_set1_ps(e);
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
      best = _mm512_max_ps(best, _mm512_fnmadd_ps(ev, _mm512_loadu_ps(d + j), _mm512_loadu_ps(s + j)));
    float lower = _mm512_reduce_max_ps(best);
    for (; j < n; ++j) lower = std::max(lower, s[j] - e * d[j]);   // the same fnmadd rounding below
    const __m512 lv = _mm512_set1_ps(lower);
    int64_t count = 0;
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (j = 0; j + 16 <= n; j += 16) {
      const __m512 upper = _mm512_fmadd_ps(ev, _mm512_loadu_ps(d + j), _mm512_loadu_ps(s + j));
      const __mmask16 hit = _mm512_cmp_ps_mask(upper, lv, _CMP_GE_OQ);
      if (hit) {
        _mm512_mask_compressstoreu_epi32(ids.data() + count, hit, index);
        count += __builtin_popcount(hit);
      }
      index = _mm512_add_epi32(index, sixteen);
    }
    for (; j < n; ++j)
      if (std::fma(e, d[j], s[j]) >= lower) ids[count++] = static_cast<int32_t>(j);
    counts[r] = count;
    if (count > max_candidates) {
      out.push_back(torch::empty({0}, torch::kInt64));
    } else {
      auto row_ids = torch::empty({count}, torch::kInt64);
      int64_t* o = row_ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < count; ++i) o[i] = ids[i];
      out.push_back(row_ids);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("screen_candidates", &screen_candidates, "(counts [M], then each row's candidate ids)");
  m.def("pack_screen", &pack_screen, "Q8_0 codes [N, K] int8 -> the screen's packed 5-bit rows");
  m.def("screen_logits", &screen_logits, "(approximate logits S, bound factor D) of every row, [M, N] each");
}
