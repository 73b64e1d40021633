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
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// How many columns ahead the tiled kernel prefetches K and V rows (a sequence's blocks lie anywhere
// in the pool). 32 streams x 64-264 columns of Gemma 3 270M, 18 layers' pools (cold, as in a step:
// the GEMMs between two layers' attention evict the KV), 1 thread: 8.6 ms at 4 columns, 6.6-7.3 at
// 16, 7.4 at 32 (noisy, shared machine); prefetching V rows into L2 during the scores: 8.4.
constexpr int64_t kPrefetchColumns = 16;

// A task's fixed work (softmax setup, the output's stores) in columns, for the thread split.
constexpr int64_t kTaskColumns = 8;

// 16 pool values as float32: float rows as they are, bf16 rows widened (bf16 is float32's top half).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// exp of 16 lanes (x <= 0 here: scores minus their maximum), Cephes' expf polynomial: x = n ln2 + r,
// |r| <= ln2 / 2, e^r to ~1 ulp, times 2^n by scalef. std::exp per score (scalar, a call each) was a
// quarter of the kernel's time at 32 streams x 164 columns; both arrangements use this one.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));   // below: 0 after scalef, as expf gives
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// s[0..n) <- exp(s - max s), 16 lanes at a time (the tail masked); returns 1 / their sum.
inline float softmax_row(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + c));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - c)) - 1u);
  vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, tail, s + c));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 sum = _mm512_setzero_ps();
  for (c = 0; c + 16 <= n; c += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c), m));
    _mm512_storeu_ps(s + c, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (c < n) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + c), m));
    _mm512_mask_storeu_ps(s + c, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
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
      for (int64_t g = 0; g < group; ++g) inv_sum[g] = softmax_row(scores.data() + g * n, n);
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


// The tiled kernel: the same arithmetic in the same order, so its output equals run()'s bit for
// bit (each score is one accumulator over d, 16 lanes at a time, then one horizontal sum; each
// output element one fma chain over the columns in order, then one multiply by 1/sum), with the
// work arranged for the core instead of for the reader:
//   scores: T columns x G heads at once, G*T independent accumulators (run() has one dependent
//     fma chain per score, 4-cycle latency each, and re-widens each K row for every head);
//   values: G heads x W 16-lane pieces of the output kept in registers over all columns (run()
//     loads and stores the output row for every column).
// G and T, W are compile-time so the accumulators stay in registers (G*T and G*W <= 24 of the 32).
template <typename T, int G, int TC>
inline void scores_tile(const float* q0, const T* kp, const int64_t* row_slots, int64_t c0,
                        int64_t n_stride, int64_t num_kv_heads, int64_t h, int64_t d, float fscale,
                        float* scores) {
  __m512 acc[G][TC];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TC; ++t) acc[g][t] = _mm512_setzero_ps();
  const T* rows[TC];
  for (int t = 0; t < TC; ++t) rows[t] = kp + (row_slots[c0 + t] * num_kv_heads + h) * d;
  // The next tile's rows (slots are scattered over the pool's blocks): fetched while this one runs.
  for (int64_t t = c0 + kPrefetchColumns; t < c0 + kPrefetchColumns + TC && t < n_stride; ++t) {
    const char* row = reinterpret_cast<const char*>(kp + (row_slots[t] * num_kv_heads + h) * d);
    for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64)
      _mm_prefetch(row + byte, _MM_HINT_T0);
  }
  for (int64_t j = 0; j < d; j += 16) {
    __m512 k[TC];
    for (int t = 0; t < TC; ++t) k[t] = load16(rows[t] + j);
    for (int g = 0; g < G; ++g) {
      const __m512 qv = _mm512_loadu_ps(q0 + g * d + j);
      for (int t = 0; t < TC; ++t) acc[g][t] = _mm512_fmadd_ps(qv, k[t], acc[g][t]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TC; ++t) scores[g * n_stride + c0 + t] = _mm512_reduce_add_ps(acc[g][t]) * fscale;
}

template <typename T, int G, int W>
inline void values_piece(const float* scores, const float* inv_sum, const T* vp,
                         const int64_t* row_slots, int64_t n, int64_t num_kv_heads, int64_t h,
                         int64_t d, int64_t j0, float* o0) {
  __m512 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) acc[g][w] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    const T* v_row = vp + (row_slots[c] * num_kv_heads + h) * d + j0;
    if (c + kPrefetchColumns < n) {  // a later row, as in scores_tile: whole on the first piece's pass
      const char* ahead = reinterpret_cast<const char*>(vp + (row_slots[c + kPrefetchColumns] * num_kv_heads + h) * d + j0);
      const int64_t bytes = j0 == 0 ? d * static_cast<int64_t>(sizeof(T)) : 16 * W * static_cast<int64_t>(sizeof(T));
      for (int64_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
    }
    __m512 v[W];
    for (int w = 0; w < W; ++w) v[w] = load16(v_row + 16 * w);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + c]);
      for (int w = 0; w < W; ++w) acc[g][w] = _mm512_fmadd_ps(p, v[w], acc[g][w]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 f = _mm512_set1_ps(inv_sum[g]);
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o0 + g * d + j0 + 16 * w, _mm512_mul_ps(f, acc[g][w]));
  }
}

// One (sequence, KV head) task's G query heads (G <= 8): scores, softmax, values.
template <typename T, int G>
void attend_heads(const float* q0, const T* kp, const T* vp, const int64_t* row_slots, int64_t n,
                  int64_t num_kv_heads, int64_t h, int64_t d, float fscale, float* scores,
                  float* inv_sum, float* o0) {
  constexpr int TC = G <= 4 ? 4 : (G <= 6 ? 4 : 3);
  int64_t c = 0;
  for (; c + TC <= n; c += TC) scores_tile<T, G, TC>(q0, kp, row_slots, c, n, num_kv_heads, h, d, fscale, scores);
  for (; c < n; ++c) scores_tile<T, G, 1>(q0, kp, row_slots, c, n, num_kv_heads, h, d, fscale, scores);
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_row(scores + g * n, n);   // as run() computes it
  constexpr int W = G <= 6 ? 4 : 2;
  int64_t j = 0;
  for (; j + 16 * W <= d; j += 16 * W) values_piece<T, G, W>(scores, inv_sum, vp, row_slots, n, num_kv_heads, h, d, j, o0);
  for (; j < d; j += 16) values_piece<T, G, 1>(scores, inv_sum, vp, row_slots, n, num_kv_heads, h, d, j, o0);
}

template <typename T>
void attend_group(const float* q0, const T* kp, const T* vp, const int64_t* row_slots, int64_t n,
                  int64_t num_kv_heads, int64_t h, int64_t d, float fscale, float* scores,
                  float* inv_sum, float* o0, int64_t group) {
  for (int64_t g0 = 0; g0 < group; g0 += 8) {  // heads in chunks of at most 8
    const int64_t heads = group - g0 < 8 ? group - g0 : 8;
    const float* q = q0 + g0 * d;
    float* o = o0 + g0 * d;
    switch (heads) {
      case 1: attend_heads<T, 1>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 2: attend_heads<T, 2>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 3: attend_heads<T, 3>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 4: attend_heads<T, 4>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 5: attend_heads<T, 5>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 6: attend_heads<T, 6>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      case 7: attend_heads<T, 7>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
      default: attend_heads<T, 8>(q, kp, vp, row_slots, n, num_kv_heads, h, d, fscale, scores, inv_sum, o); break;
    }
  }
}

template <typename T>
void run_tiled(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* np,
               float* op, int64_t b, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               int64_t columns, float fscale) {
  const int64_t group = num_heads / num_kv_heads;
  // Contiguous runs of tasks of equal cost (columns plus a fixed share for the per-task work), one
  // per thread: parallel_for's equal task counts left one thread with the longer contexts.
  const int64_t num_tasks = b * num_kv_heads;
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> bounds(num_parts + 1, num_tasks);
  bounds[0] = 0;
  if (num_parts > 1) {
    int64_t total = 0;
    for (int64_t task = 0; task < num_tasks; ++task) total += np[task / num_kv_heads] + kTaskColumns;
    int64_t done = 0, part = 1;
    for (int64_t task = 0; task < num_tasks && part < num_parts; ++task) {
      done += np[task / num_kv_heads] + kTaskColumns;
      while (part < num_parts && done * num_parts >= total * part) bounds[part++] = task + 1;
    }
  }
  at::parallel_for(0, num_parts, 1, [&](int64_t first_part, int64_t end_part) {
    std::vector<float> scores;
    float inv_sum[8];
    for (int64_t task = bounds[first_part]; task < bounds[end_part]; ++task) {
      const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t n = np[i];
      if (static_cast<int64_t>(scores.size()) < 8 * n) scores.resize(8 * n);
      attend_group(qp + (i * num_heads + h * group) * d, kp, vp, sp + i * columns, n, num_kv_heads,
                   h, d, fscale, scores.data(), inv_sum, op + (i * num_heads + h * group) * d, group);
    }
  });
}

}  // namespace

// q [b, H, D] float32; k_cache, v_cache [slots, Hkv, D] float32 or bfloat16; slots [b, C] int64
// (column c of sequence i); spans [b] int64 (valid columns of each sequence, >= 1); tiled: run_tiled
// (else run: the same figures bit for bit, slower). Returns float32 [b, H, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor spans, double scale, bool tiled) {
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
  auto out = tiled ? torch::empty_like(q) : torch::zeros_like(q);
  const float fscale = static_cast<float>(scale);
  if (tiled && k_cache.dtype() == torch::kFloat32) {
    run_tiled(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
              slots.data_ptr<int64_t>(), spans.data_ptr<int64_t>(), out.data_ptr<float>(),
              b, num_heads, num_kv_heads, d, columns, fscale);
  } else if (tiled) {
    run_tiled(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
              reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(),
              spans.data_ptr<int64_t>(), out.data_ptr<float>(), b, num_heads, num_kv_heads, d, columns, fscale);
  } else if (k_cache.dtype() == torch::kFloat32) {
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
