// Shared by the builds of the int8 x int8 GEMM on GGUF block codes (servelm/model/gguf/gguf_i8gemm.cpp,
// AVX512-VNNI; gguf_i8gemm_avx2.cpp, AVX2 + FMA): buffers left uninitialised, the checks of i8_gemm's
// arguments and its output, the tensors of ``quantize``, and the LM-head screen's state, row bounds and
// candidates (``i8_screen``). Plain C++ and torch: no vector instructions.
#pragma once

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace servelm_i8gemm {

// A vector whose new elements are left uninitialised (every one is written before it is read): a
// prompt chunk's codes are megabytes, and zeroing them first took a fifth of the rounding's time (K = 4864).
template <class T>
struct Uninitialised : std::allocator<T> {
  template <class U>
  struct rebind { using other = Uninitialised<U>; };
  template <class U>
  void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) { ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...); }
};
template <class T>
using Buffer = std::vector<T, Uninitialised<T>>;

// i8_gemm's arguments checked (x [M, K]; codes packed in tiles of ``cols`` vectors of 16 outputs, scales and
// offsets alike; a bias of n outputs; ``out`` [M, >= n]), ``n`` resolved (-1: every packed output), and the
// tensor the results go to: ``out``, or a new [M, n] one (float32, bfloat16 where ``bf16_out``).
inline torch::Tensor gemm_output(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                 const c10::optional<torch::Tensor>& offsets, int64_t block, bool bf16_out, int64_t& n,
                                 const c10::optional<torch::Tensor>& out, const c10::optional<torch::Tensor>& bias,
                                 int64_t cols) {
  TORCH_CHECK((x.dtype() == torch::kBFloat16 || x.dtype() == torch::kFloat32) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous bfloat16 or float32 [M, K]");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  const int64_t rows = x.size(0), k = x.size(1), nb = k / block;
  TORCH_CHECK(k % block == 0, "K must be a multiple of the block");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 5 && codes.size(1) == k / 4
              && codes.size(2) == cols && codes.size(3) == 16 && codes.size(4) == 4,
              "codes: packed uint8 [tiles, K / 4, ", cols, ", 16, 4]");
  if (n < 0) n = codes.size(0) * 16 * cols;
  TORCH_CHECK(n <= codes.size(0) * 16 * cols, "n: at most the packed outputs");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 4
              && scales.size(0) == codes.size(0) && scales.size(1) == nb && scales.size(2) == cols
              && scales.size(3) == 16, "scales: packed float32 [tiles, K / block, ", cols, ", 16]");
  if (offsets.has_value() && offsets->defined())
    TORCH_CHECK(offsets->dtype() == torch::kFloat32 && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: packed float32 like scales");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK((bias->dtype() == torch::kFloat32 || bias->dtype() == torch::kBFloat16) && bias->dim() == 1
                && bias->numel() == n && bias->is_contiguous(), "bias: contiguous float32 or bfloat16 [n]");
  const auto out_dtype = bf16_out ? torch::kBFloat16 : torch::kFloat32;
  if (!out.has_value() || !out->defined()) return torch::empty({rows, n}, x.options().dtype(out_dtype));
  const torch::Tensor& y = *out;
  TORCH_CHECK(y.dtype() == out_dtype && y.dim() == 2 && y.size(0) == rows && y.size(1) >= n && y.stride(1) == 1
              && y.stride(0) >= n, "out: [M, >= n] rows of the output dtype");
  return y;
}

// ``quantize``'s checks and tensors: x [M, K] rounded by ``round(x_data, rows, k)`` (float32 or bf16 bits, as
// the build's quantize_rows takes them) -> (int8 codes [M, K], float32 scales [M, K / block]).
template <class Round>
std::vector<torch::Tensor> quantized_tensors(const torch::Tensor& x, int64_t block, const Round& round) {
  TORCH_CHECK((x.dtype() == torch::kBFloat16 || x.dtype() == torch::kFloat32) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous bfloat16 or float32 [M, K]");
  TORCH_CHECK((block == 16 || block == 32) && x.size(1) % block == 0, "block 16 or 32 dividing K");
  const int64_t rows = x.size(0), k = x.size(1);
  const auto q = x.dtype() == torch::kFloat32
      ? round(x.data_ptr<float>(), rows, k)
      : round(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, k);
  auto codes = torch::empty({rows, k}, torch::kInt8);
  auto scales = torch::empty({rows, k / block}, torch::kFloat32);
  std::memcpy(codes.data_ptr<int8_t>(), q.codes.data(), q.codes.size());
  std::memcpy(scales.data_ptr<float>(), q.scales.data(), q.scales.size() * sizeof(float));
  return {codes, scales};
}

// i8_screen's per-thread state: per activation row, the largest lower bound S - E met so far and the
// outputs (with their upper bounds S + E) that reached it when they were met. Each build's epilogue
// (``screen_tile``) meets an accumulator block's results with the bound of its outputs,
//   E = min(row_sum[m] x bound_max[v], row_max[m] x bound_sum[v]).
struct ScreenState {
  const float* bound_max = nullptr;   // [n] per output: max over blocks of |scale| x sum |codes|
  const float* bound_sum = nullptr;   // [n] per output: their sum
  const float* row_sum = nullptr;     // [M] per row: e x sum over blocks of the block's absmax
  const float* row_max = nullptr;     // [M] per row: e x max over blocks of the block's absmax
  std::vector<float> lower;                  // [M]
  std::vector<std::vector<int32_t>> ids;     // [M]
  std::vector<std::vector<float>> upper;     // [M]

  // The call's state before any thread's: the outputs' bound factors (float32 [n]) and the rows' ones.
  static ScreenState over(const torch::Tensor& bound_max, const torch::Tensor& bound_sum,
                          const std::vector<float>& row_sum, const std::vector<float>& row_max) {
    ScreenState state;
    state.bound_max = bound_max.data_ptr<float>();
    state.bound_sum = bound_sum.data_ptr<float>();
    state.row_sum = row_sum.data();
    state.row_max = row_max.data();
    return state;
  }

  // A thread's own copy: the shared pointers, its rows' state empty.
  ScreenState fresh(int64_t rows) const {
    ScreenState own;
    own.bound_max = bound_max;
    own.bound_sum = bound_sum;
    own.row_sum = row_sum;
    own.row_max = row_max;
    own.lower.assign(rows, -INFINITY);
    own.ids.assign(rows, {});
    own.upper.assign(rows, {});
    for (auto& v : own.ids) v.reserve(256);
    for (auto& v : own.upper) v.reserve(256);
    return own;
  }

  // Output ``id`` with upper bound ``up`` reached row ``row``'s lower bound when it was met.
  void keep(int64_t row, int32_t id, float up) {
    ids[row].push_back(id);
    upper[row].push_back(up);
  }
};

// i8_screen's arguments checked (x contiguous float32 [M, K], K a multiple of 32; codes packed in tiles of
// ``cols`` vectors of 16 outputs with scales alike; bounds float32 [n]).
inline void check_screen_args(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales, int64_t n,
                              const torch::Tensor& bound_max, const torch::Tensor& bound_sum, int64_t cols) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 5 && codes.size(1) == k / 4
              && codes.size(2) == cols && codes.size(3) == 16 && codes.size(4) == 4,
              "codes: packed uint8 [tiles, K / 4, ", cols, ", 16, 4]");
  TORCH_CHECK(n > 0 && n <= codes.size(0) * 16 * cols, "n: at most the packed outputs");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 4
              && scales.size(0) == codes.size(0) && scales.size(1) == k / 32, "scales: packed float32 [tiles, K / 32, ...]");
  for (const auto* t : {&bound_max, &bound_sum})
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->numel() == n, "bounds: float32 [n]");
}

// Whether each row of x [rows, k] is finite throughout (a row that is not has no candidates).
inline std::vector<bool> finite_rows(const float* x, int64_t rows, int64_t k) {
  std::vector<bool> finite(rows, true);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i)
      if (!std::isfinite(x[r * k + i])) {
        finite[r] = false;
        break;
      }
  return finite;
}

// row_sum[r], row_max[r]: e times the sum and the max over blocks of the block's absmax, levels x d (d: the
// activation scales [rows, nb], each absmax / levels).
inline void screen_row_bounds(const float* d, int64_t rows, int64_t nb, float levels, float e,
                              std::vector<float>& row_sum, std::vector<float>& row_max) {
  row_sum.resize(rows);
  row_max.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f, most = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float amax = levels * d[r * nb + b];
      sum += amax;
      most = std::max(most, amax);
    }
    row_sum[r] = e * sum;
    row_max[r] = e * most;
  }
}

// i8_screen's result from the threads' states (each with the first tile of its range): [counts (int64 [M]),
// then per row the outputs whose upper bound reaches the largest lower bound of all threads (int64,
// ascending; empty where the count exceeds max_candidates; none for a row that is not finite)].
inline std::vector<torch::Tensor> screen_candidates(std::vector<std::pair<int64_t, ScreenState>>& states, int64_t rows,
                                                    const std::vector<bool>& finite, int64_t max_candidates) {
  std::sort(states.begin(), states.end(), [](const auto& l, const auto& r) { return l.first < r.first; });
  std::vector<torch::Tensor> out(rows + 1);
  auto counts = torch::zeros({rows}, torch::kInt64);
  out[0] = counts;
  int64_t* count_out = counts.data_ptr<int64_t>();
  std::vector<int64_t> ids;
  for (int64_t r = 0; r < rows; ++r) {
    float lower = -INFINITY;
    for (const auto& state : states) lower = std::max(lower, state.second.lower[r]);
    ids.clear();
    if (finite[r])
      for (const auto& state : states)
        for (size_t i = 0; i < state.second.ids[r].size(); ++i)
          if (state.second.upper[r][i] >= lower) ids.push_back(state.second.ids[r][i]);
    const int64_t count = static_cast<int64_t>(ids.size());
    count_out[r] = count;
    auto row_ids = torch::empty({count > max_candidates ? 0 : count}, torch::kInt64);
    if (count <= max_candidates) std::copy(ids.begin(), ids.end(), row_ids.data_ptr<int64_t>());
    out[r + 1] = row_ids;
  }
  return out;
}

}  // namespace servelm_i8gemm
