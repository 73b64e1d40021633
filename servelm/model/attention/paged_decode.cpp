// Decode attention (one query per sequence) read in place from the paged float32 KV pool:
//   out[i, h] = softmax(scale * q[i, h] . K[slot(i, c)]) over c < span[i], weighted sum of V rows.
// The torch path gathers every context row into a padded copy (index_select) and SDPA reads the
// copy again; here each K and V row is read once, from the pool, for all query heads sharing its
// KV head. One task per (sequence, KV head); float32 arithmetic over a float32 or bfloat16 pool
// (bf16 rows widened in registers), D a multiple of 16 (AVX-512).
//
// Compiled at run time by servelm/model/attention/paged_decode.py with -mavx512f; the Python side
// checks the CPU flag and the shapes before it calls this.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// 16 pool values as float32: float rows as they are, bf16 rows widened (bf16 is float32's top half).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), load16(b + j), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t d) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t j = 0; j < d; j += 16) {
    _mm512_storeu_ps(y + j, _mm512_fmadd_ps(a, load16(x + j), _mm512_loadu_ps(y + j)));
  }
}

template <typename T>
void run(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* np, float* op,
         int64_t b, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t columns, float fscale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, b * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> inv_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t n = np[i];
      const int64_t* row_slots = sp + i * columns;
      scores.assign(group * n, 0.0f);
      const float* q0 = qp + (i * num_heads + h * group) * d;
      for (int64_t c = 0; c < n; ++c) {
        const T* k_row = kp + (row_slots[c] * num_kv_heads + h) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * n + c] = dot(q0 + g * d, k_row, d) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < n; ++c) m = s[c] > m ? s[c] : m;
        float sum = 0.0f;
        for (int64_t c = 0; c < n; ++c) { s[c] = std::exp(s[c] - m); sum += s[c]; }
        inv_sum[g] = 1.0f / sum;
      }
      float* o0 = op + (i * num_heads + h * group) * d;
      for (int64_t c = 0; c < n; ++c) {
        const T* v_row = vp + (row_slots[c] * num_kv_heads + h) * d;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + c], v_row, o0 + g * d, d);
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 f = _mm512_set1_ps(inv_sum[g]);
        float* o = o0 + g * d;
        for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(o + j, _mm512_mul_ps(f, _mm512_loadu_ps(o + j)));
      }
    }
  });
}

}  // namespace

// q [b, H, D] float32; k_cache, v_cache [slots, Hkv, D] float32 or bfloat16; slots [b, C] int64
// (column c of sequence i); spans [b] int64 (valid columns of each sequence, >= 1). Returns
// float32 [b, H, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor spans, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "float32 q");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() &&
              (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kBFloat16),
              "float32 or bfloat16 KV pool");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              slots.is_contiguous() && spans.is_contiguous(), "contiguous inputs");
  const int64_t b = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), columns = slots.size(1);
  TORCH_CHECK(d % 16 == 0 && k_cache.size(2) == d && v_cache.size(2) == d, "head_dim % 16");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads a multiple of KV heads");
  auto out = torch::zeros_like(q);
  const float fscale = static_cast<float>(scale);
  if (k_cache.dtype() == torch::kFloat32) {
    run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
        slots.data_ptr<int64_t>(), spans.data_ptr<int64_t>(), out.data_ptr<float>(),
        b, num_heads, num_kv_heads, d, columns, fscale);
  } else {
    run(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(),
        spans.data_ptr<int64_t>(), out.data_ptr<float>(), b, num_heads, num_kv_heads, d, columns, fscale);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a float32 or bf16 pool (AVX-512)");
}
