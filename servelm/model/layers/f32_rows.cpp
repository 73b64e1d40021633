// Float32 linear for few rows (AVX2 + FMA): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W row-major as
// stored (no repack). Each weight row is read from memory once for all M rows: a thread takes a
// range of output blocks (4 outputs, then 1 at the tail), and for each block runs every pair of x
// rows against it while the block's 4 weight rows (4 * K * 4 bytes: 16 KB at K = 1024) stay in L1.
// Per 8 inputs a 4x2 tile loads 4 weight vectors and 2 x vectors for 8 FMAs into 8 accumulators
// (13 of the 16 ymm registers), then each accumulator is summed across its lanes once per block.
// Inputs past the last multiple of 8 are read with masked loads (odd K).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kOutputs = 4;  // outputs per block (weight rows streamed together)
constexpr int64_t kRows = 2;     // x rows per tile

inline __m256i tail_mask(int64_t left) {
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - left));
}

// The 8 lanes of each of a, b, c, d summed: [sum a, sum b, sum c, sum d].
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline float sum1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R x rows (R = 1 or 2) against NB weight rows (NB = 4 or 1): out[r * ldy + j] = x_r . w_j.
template <int R, int NB>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out,
                 int64_t ldy, const float* bias) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t body = k & ~int64_t(7);
  for (int64_t i = 0; i < body; i += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (body < k) {
    const __m256i mask = tail_mask(k - body);
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(w + j * ldw + body, mask);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * ldx + body, mask);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (NB == 4) {
      __m128 s = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      if (bias != nullptr) s = _mm_add_ps(s, _mm_loadu_ps(bias));
      _mm_storeu_ps(out + r * ldy, s);
    } else {
      for (int j = 0; j < NB; ++j) out[r * ldy + j] = sum1(acc[r][j]) + (bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

// Every x row against the NB weight rows starting at output n.
template <int NB>
inline void block(const float* x, int64_t m, int64_t k, const float* w, int64_t ldw, int64_t n,
                  float* y, int64_t ldy, const float* bias) {
  const float* wn = w + n * ldw;
  const float* bn = bias != nullptr ? bias + n : nullptr;
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) tile<kRows, NB>(x + r * k, k, wn, ldw, k, y + r * ldy + n, ldy, bn);
  if (r < m) tile<1, NB>(x + r * k, k, wn, ldw, k, y + r * ldy + n, ldy, bn);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "f32_rows.linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "f32_rows.linear: float32 only");
  TORCH_CHECK(x.is_contiguous(), "f32_rows.linear: x must be contiguous");
  TORCH_CHECK(weight.stride(1) == 1, "f32_rows.linear: weight rows must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "f32_rows.linear: x has ", k, " inputs, weight ", weight.size(1));
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "f32_rows.linear: bias must be float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t ldw = weight.stride(0);
  float* yp = y.data_ptr<float>();
  const int64_t blocks = n / kOutputs;
  // grain: 16 blocks (64 outputs) at least per task, so a small N is not split to no gain
  at::parallel_for(0, blocks + (n % kOutputs != 0 ? 1 : 0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (b < blocks) {
        block<kOutputs>(xp, m, k, wp, ldw, b * kOutputs, yp, n, bias_ptr);
      } else {
        for (int64_t j = blocks * kOutputs; j < n; ++j) block<1>(xp, m, k, wp, ldw, j, yp, n, bias_ptr);
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "float32 x[M, K] @ W[N, K]^T (+ bias) for few rows, W read once (AVX2 + FMA)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
}
