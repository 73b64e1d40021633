// Shared by the builds of the int8 x int8 GEMM on GGUF block codes (servelm/model/gguf/gguf_i8gemm.cpp,
// AVX512-VNNI; gguf_i8gemm_avx2.cpp, AVX2 + FMA): buffers left uninitialised, the checks of i8_gemm's
// arguments and its output, and the tensors of ``quantize``. Plain C++ and torch: no vector instructions.
#pragma once

#include <torch/extension.h>
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

}  // namespace servelm_i8gemm
