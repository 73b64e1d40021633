// Decode attention (one query per sequence) read in place from the paged float32 KV pool:
//   out[i, h] = softmax(scale * q[i, h] . K[slot(i, c)]) over c < span[i], weighted sum of V rows.
// The torch path gathers every context row into a padded copy (index_select) and SDPA reads the
// copy again; here each K and V row is read once, from the pool, for all query heads sharing its
// KV head. A sequence's columns are taken in segments of a fixed length, merged in order
// (kSegmentColumns); float32 arithmetic over a float32 or bfloat16 pool (bf16 rows widened in
// registers), D a multiple of the vector's lanes.
//
// One source, two builds (servelm/model/attention/paged_decode.py compiles it at run time and picks
// the build by the CPU's flags): with -mavx512f the vectors are 16 lanes (zmm, 32 registers), with
// -mavx2 -mfma (no AVX-512: AMD Zen 1-3, most desktops and laptops) 8 lanes (ymm, 16 registers).
// The kernel below is written once over the small vector layer ``vec`` (kLanes lanes, servelm_vec.h);
// only that layer and the register tiles' sizes differ. The two builds compute the same floats up to the order
// of their horizontal sums (16 lanes vs 8); the Python side checks the flags and the shapes first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "servelm_parallel.h"
#include "servelm_row_attention.h"
#include "servelm_vec.h"

namespace {

// How many columns ahead the tiled kernel prefetches K and V rows (a sequence's blocks lie anywhere
// in the pool). 32 streams x 64-264 columns of Gemma 3 270M, 18 layers' pools (cold, as in a step:
// the GEMMs between two layers' attention evict the KV), 1 thread: 8.6 ms at 4 columns, 6.6-7.3 at
// 16, 7.4 at 32 (noisy, shared machine); prefetching V rows into L2 during the scores: 8.4.
constexpr int64_t kPrefetchColumns = 16;
// and how far ahead it asks for them into L2 as well, so that the near prefetch finds them there: a
// task's columns come from memory at a few GB/s otherwise (cold pools, one task per thread at a time).
// Qwen2.5-Coder 0.5B (14/2 heads, D 64) and Gemma 3 270M (4/1, D 256) at 32 streams x ~200 columns,
// bf16 pools, 2 threads, builds alternated in one process (AMD EPYC Zen 4 VM): cold pools (24 layers'
// worth) 360 -> 328 and 490 -> 417 us a layer (blocks per sequence as the engine allocates them),
// 453 -> 396 and 644 -> 505 (blocks scattered); in cache 194 -> 200 and 165 -> 184 (the prefetches'
// own cost). A decode step meets its pools cold: the GEMMs between two layers' attention evict them.
constexpr int64_t kFarColumns = 64;
// The values pass runs over the columns in chunks of this many: every piece of the output (a pass of G
// heads x W lanes) takes the chunk's V rows while they are in L1 (128 float32 rows of D 64: 32 KiB),
// its partial sums stored in the output between chunks (each output element is still one fma chain
// over the columns in order: the same floats). Unchunked, the later passes over a long context re-read
// V from L3 or memory: Qwen2.5-Coder 0.5B's layer (14/2 heads, D 64, float32 pool, cold), 2 threads,
// AMD EPYC Zen 3 VM (AVX2): 4,096 columns 0.51 -> 0.42 ms, 8,192 1.01 -> 0.82 (64 and 256 columns a
// chunk: 0.53, 0.58 ms); at 256 columns the same.
constexpr int64_t kValueColumns = 128;

// Row ``slot``'s D values of KV head h in ``pool``, fetched toward the cache level ``kHint`` names.
template <enum _mm_hint kHint, typename T>
inline void prefetch_row(const T* pool, int64_t slot, int64_t num_kv_heads, int64_t h, int64_t d) {
  const char* row = reinterpret_cast<const char*>(pool + (slot * num_kv_heads + h) * d);
  for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) _mm_prefetch(row + byte, kHint);
}

namespace vec = servelm_vec::vec;
using servelm_vec::exp_lanes;
using servelm_vec::kLanes;

// s[0..n) <- exp(s - max s), kLanes at a time (the tail masked); returns their sum, the max at *top.
inline float softmax_sum(float* s, int64_t n, float* top) {
  vec::F vm = vec::set1(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) vm = vec::max(vm, vec::load(s + c));
  const vec::Tail tail = vec::tail(n - c);
  if (c < n) vm = vec::max(vm, vec::load_tail(s + c, tail, -std::numeric_limits<float>::infinity()));
  *top = vec::max_lane(vm);
  const vec::F m = vec::set1(*top);
  vec::F sum = vec::zero();
  for (c = 0; c + kLanes <= n; c += kLanes) {
    const vec::F e = exp_lanes(vec::sub(vec::load(s + c), m));
    vec::store(s + c, e);
    sum = vec::add(sum, e);
  }
  if (c < n) {
    const vec::F e = exp_lanes(vec::sub(vec::load_tail(s + c, tail, 0.0f), m));
    vec::store_tail(s + c, tail, e);
    sum = vec::add(sum, vec::keep_tail(tail, e));
  }
  return vec::sum(sum);
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  vec::F acc = vec::zero();
  for (int64_t j = 0; j < d; j += kLanes) acc = vec::fmadd(vec::load(a + j), vec::load(b + j), acc);
  return vec::sum(acc);
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t d) {
  const vec::F a = vec::set1(alpha);
  for (int64_t j = 0; j < d; j += kLanes) vec::store(y + j, vec::fmadd(a, vec::load(x + j), vec::load(y + j)));
}

// A row's columns are cut into segments of this many, each segment's softmax and values computed on their
// own and merged in order (merge_segments): a task of the tiled kernel is a segment (all query heads, or
// a part of them), so one long row keeps every thread busy, and a segment's V rows (512 x D floats of a
// KV head: 128 KiB at D 64) stay in L2 from the scores pass, which fetches them, to the values pass.
// Fixed: a row's floats depend on its length only, never on the threads or the rows beside it (a row of
// at most this many columns takes one segment: the floats of a plain softmax). Qwen2.5-Coder 0.5B's layer
// (14/2 heads, D 64, float32 pool on huge pages, cold), 2 threads, AMD EPYC Zen 3 VM (AVX2), against one
// task per (row, KV head) and no V prefetch in the scores pass: 1 x 4,096 columns 1.13x, 8 x 1,024-4,096
// 1.16x, 32 x 256-4,096 1.15-1.22x; Gemma 3 270M's (4/1, D 256), 1 x 4,096: 1.94x (one KV head was one
// task: one thread). The segments or the V prefetch alone: within the noise. 256 and 1,024 columns a
// segment: within the noise of 512.
constexpr int64_t kSegmentColumns = 512;

inline int64_t row_segments(int64_t n) { return n <= kSegmentColumns ? 1 : (n + kSegmentColumns - 1) / kSegmentColumns; }

// Floats of a row's partial results: [segments, H, D] unnormalized outputs, [segments, H] maxima,
// [segments, H] sums of exps; none for a row of one segment (written in place, normalized).
inline int64_t partial_floats(int64_t n, int64_t num_heads, int64_t d) {
  const int64_t segments = row_segments(n);
  return segments == 1 ? 0 : segments * num_heads * (d + 2);
}

// Head q of a row of ``segments`` segments from their partial results (partial_floats' layout):
// out = (sum_s w_s o_s) / (sum_s w_s l_s), w_s = exp(m_s - max_s m_s), the segments in order.
inline void merge_segments(int64_t segments, const float* partial, int64_t num_heads, int64_t d, int64_t q,
                           float* out) {
  const float* tops = partial + segments * num_heads * d;
  const float* totals = tops + segments * num_heads;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < segments; ++s) top = std::max(top, tops[s * num_heads + q]);
  float weights[64];
  float total = 0.0f;
  for (int64_t s0 = 0; s0 < segments; s0 += 64) {   // 64 segments at a time (32,768 columns)
    const int64_t s1 = std::min(segments, s0 + 64);
    for (int64_t s = s0; s < s1; ++s) {
      weights[s - s0] = std::exp(tops[s * num_heads + q] - top);
      total += weights[s - s0] * totals[s * num_heads + q];
    }
    for (int64_t j = 0; j < d; j += kLanes) {
      vec::F acc = s0 == 0 ? vec::zero() : vec::load(out + j);
      for (int64_t s = s0; s < s1; ++s)
        acc = vec::fmadd(vec::set1(weights[s - s0]), vec::load(partial + (s * num_heads + q) * d + j), acc);
      vec::store(out + j, acc);
    }
  }
  const vec::F f = vec::set1(1.0f / total);
  for (int64_t j = 0; j < d; j += kLanes) vec::store(out + j, vec::mul(f, vec::load(out + j)));
}

// Heads [q_begin, q_end) of a row of n columns (more than one segment) from its partial results, into
// out_row [H, D] (the row's outputs).
inline void merge_heads(int64_t n, const float* partial, int64_t num_heads, int64_t d, int64_t q_begin, int64_t q_end,
                        float* out_row) {
  for (int64_t q = q_begin; q < q_end; ++q) merge_segments(row_segments(n), partial, num_heads, d, q, out_row + q * d);
}

// Where each row's partial results start in one buffer for the batch ([b + 1]: the last, its size).
inline std::vector<int64_t> partial_offsets(const int64_t* np, int64_t b, int64_t num_heads, int64_t d) {
  std::vector<int64_t> offsets(b + 1, 0);
  for (int64_t i = 0; i < b; ++i) offsets[i + 1] = offsets[i] + partial_floats(np[i], num_heads, d);
  return offsets;
}

// The merges of every row of more than one segment, (row, head) tasks across the threads (the plain run()'s).
inline void merge_rows(const int64_t* np, int64_t b, int64_t num_heads, int64_t d, const std::vector<int64_t>& offsets,
                       const float* partial, float* op) {
  if (offsets[b] == 0) return;
  servelm_parallel::dynamic_for(b * num_heads, b * num_heads, [&](int64_t task, int64_t) {
    const int64_t i = task / num_heads, q = task % num_heads;
    if (offsets[i + 1] > offsets[i]) merge_heads(np[i], partial + offsets[i], num_heads, d, q, q + 1, op + i * num_heads * d);
  });
}

template <typename T>
void run(const float* qp, int64_t q_row, const T* kp, const T* vp, const int64_t* sp, const int64_t* np,
         float* op, int64_t b, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t columns, float fscale) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<int64_t> offsets = partial_offsets(np, b, num_heads, d);
  std::vector<float> partial(offsets[b], 0.0f);
  at::parallel_for(0, b * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> inv_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t segments = row_segments(np[i]);
      const float* q0 = qp + i * q_row + h * group * d;
      for (int64_t s = 0; s < segments; ++s) {
        const int64_t c0 = s * kSegmentColumns, n = std::min(np[i], c0 + kSegmentColumns) - c0;
        const int64_t* row_slots = sp + i * columns + c0;
        float* row_partial = partial.data() + offsets[i];
        float* o0 = (segments == 1 ? op + i * num_heads * d : row_partial + s * num_heads * d) + h * group * d;
        scores.assign(group * n, 0.0f);
        for (int64_t c = 0; c < n; ++c) {
          const T* k_row = kp + (row_slots[c] * num_kv_heads + h) * d;
          for (int64_t g = 0; g < group; ++g) scores[g * n + c] = dot(q0 + g * d, k_row, d) * fscale;
        }
        for (int64_t g = 0; g < group; ++g) {
          float top;
          const float sum = softmax_sum(scores.data() + g * n, n, &top);
          inv_sum[g] = 1.0f / sum;
          if (segments > 1) {
            const int64_t q = s * num_heads + h * group + g;
            row_partial[segments * num_heads * d + q] = top;
            row_partial[segments * num_heads * (d + 1) + q] = sum;
          }
        }
        for (int64_t c = 0; c < n; ++c) {
          const T* v_row = vp + (row_slots[c] * num_kv_heads + h) * d;
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + c], v_row, o0 + g * d, d);
        }
        if (segments > 1) continue;
        for (int64_t g = 0; g < group; ++g) {
          const vec::F f = vec::set1(inv_sum[g]);
          float* o = o0 + g * d;
          for (int64_t j = 0; j < d; j += kLanes) vec::store(o + j, vec::mul(f, vec::load(o + j)));
        }
      }
    }
  });
  merge_rows(np, b, num_heads, d, offsets, partial.data(), op);
}


// The tiled kernel: the same arithmetic in the same order, so its output equals run()'s bit for
// bit (each score is one accumulator over d, kLanes lanes at a time, then one horizontal sum; each
// output element one fma chain over the columns in order, then one multiply by 1/sum), with the
// work arranged for the core instead of for the reader:
//   scores: T columns x G heads at once, G*T independent accumulators (run() has one dependent
//     fma chain per score, 4-cycle latency each, and re-widens each K row for every head);
//   values: G heads x W kLanes-lane pieces of the output kept in registers over a chunk of
//     kValueColumns columns (run() loads and stores the output row for every column).
// G and T, W are compile-time so the accumulators stay in registers: G*T (+ T rows + q) and G*W
// (+ W rows + a score) within the 32 zmm registers (AVX-512: G*T, G*W <= 24) or the 16 ymm (AVX2:
// at most 15, fewer columns and pieces per pass as G grows).
// value_heads: the values pass takes at most that many heads at once (AVX2: 7 or 8 heads as 4 + the
// rest, not all at 1 piece, which read each V row and broadcast each score 8 times per 64 lanes; 4
// heads at 3 pieces, 12 accumulators + 3 rows + a score: Qwen's 7 heads take 3 + 3 + 2 pieces over D 64
// instead of 4 x 2, 2-4% less time a layer at 1,024-4,096 columns; the last two as one pass of 2, not two
// of 1, whose 4 fma chains a column wait on their latency: 1.06x hot at 1 thread). The loops over G, T and W
// are unrolled by pragma: without it GCC kept the G = 7 accumulators in memory (a store per accumulator
// per step). qwen2.5-coder-0.5b's layer (14 q heads, 2 KV heads, D 64, float32 pool), 1 thread, 2 tasks,
// standalone: 167 columns 27.2 -> 22.4 us, 1000 columns 204 -> 166 us (AMD EPYC Zen 3 VM, AVX2).
#if defined(__AVX512F__)
constexpr int score_columns(int g) { return g <= 6 ? 4 : 3; }
constexpr int value_pieces(int g) { return g <= 6 ? 4 : 2; }
constexpr int value_heads(int g) { return g; }
#else
constexpr int score_columns(int g) { return g <= 2 ? 4 : (g == 3 ? 3 : (g <= 6 ? 2 : 1)); }
constexpr int value_pieces(int g) { return g <= 2 ? 4 : (g <= 4 ? 3 : (g <= 6 ? 2 : 1)); }
constexpr int value_heads(int g) { return g <= 6 ? g : 4; }
#endif

template <typename T, int G, int TC>
inline void scores_tile(const float* q0, const T* kp, const T* vp, const int64_t* row_slots, int64_t c0,
                        int64_t n_stride, int64_t num_kv_heads, int64_t h, int64_t d, float fscale,
                        float* scores) {
  vec::F acc[G][TC];
  _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g)
    _Pragma("GCC unroll 16") for (int t = 0; t < TC; ++t) acc[g][t] = vec::zero();
  const T* rows[TC];
  _Pragma("GCC unroll 16") for (int t = 0; t < TC; ++t) rows[t] = kp + (row_slots[c0 + t] * num_kv_heads + h) * d;
  // The next tile's rows (slots are scattered over the pool's blocks): fetched while this one runs.
  for (int64_t t = c0 + kPrefetchColumns; t < c0 + kPrefetchColumns + TC && t < n_stride; ++t)
    prefetch_row<_MM_HINT_T0>(kp, row_slots[t], num_kv_heads, h, d);
  // and into L2 the K rows further on, and (vp not null) the V rows of the same columns: the values pass of
  // the segment (at most kSegmentColumns columns) then finds them there
  for (int64_t t = c0 + kFarColumns; t < c0 + kFarColumns + TC && t < n_stride; ++t) {
    prefetch_row<_MM_HINT_T1>(kp, row_slots[t], num_kv_heads, h, d);
    if (vp != nullptr) prefetch_row<_MM_HINT_T1>(vp, row_slots[t], num_kv_heads, h, d);
  }
  for (int64_t j = 0; j < d; j += kLanes) {
    vec::F k[TC];
    _Pragma("GCC unroll 16") for (int t = 0; t < TC; ++t) k[t] = vec::load(rows[t] + j);
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g) {
      const vec::F qv = vec::load(q0 + g * d + j);
      _Pragma("GCC unroll 16") for (int t = 0; t < TC; ++t) acc[g][t] = vec::fmadd(qv, k[t], acc[g][t]);
    }
  }
  _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g)
    _Pragma("GCC unroll 16") for (int t = 0; t < TC; ++t) scores[g * n_stride + c0 + t] = vec::sum(acc[g][t]) * fscale;
}

template <typename T, int G, int W>
inline void values_piece(const float* scores, const float* inv_sum, const T* vp,
                         const int64_t* row_slots, int64_t n, int64_t num_kv_heads, int64_t h,
                         int64_t d, int64_t j0, float* o0, bool prefetch, int64_t c0, int64_t c1) {
  vec::F acc[G][W];
  if (c0 == 0) {
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g)
      _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) acc[g][w] = vec::zero();
  } else {
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g)
      _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) acc[g][w] = vec::load(o0 + g * d + j0 + kLanes * w);
  }
  for (int64_t c = c0; c < c1; ++c) {
    const T* v_row = vp + (row_slots[c] * num_kv_heads + h) * d + j0;
    if (prefetch && c + kPrefetchColumns < n)   // a later row, whole, on the first pass only
      prefetch_row<_MM_HINT_T0>(vp, row_slots[c + kPrefetchColumns], num_kv_heads, h, d);
    if (prefetch && c + kFarColumns < n) prefetch_row<_MM_HINT_T1>(vp, row_slots[c + kFarColumns], num_kv_heads, h, d);
    vec::F v[W];
    _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) v[w] = vec::load(v_row + kLanes * w);
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g) {
      const vec::F p = vec::set1(scores[g * n + c]);
      _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) acc[g][w] = vec::fmadd(p, v[w], acc[g][w]);
    }
  }
  if (c1 == n && inv_sum != nullptr) {
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g) {
      const vec::F f = vec::set1(inv_sum[g]);
      _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) vec::store(o0 + g * d + j0 + kLanes * w, vec::mul(f, acc[g][w]));
    }
  } else {
    _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g)
      _Pragma("GCC unroll 16") for (int w = 0; w < W; ++w) vec::store(o0 + g * d + j0 + kLanes * w, acc[g][w]);
  }
}

// The values of G heads (scores [G, n], their 1 / sums, or null: the sums left raw; outputs [G, D]), W pieces
// of kLanes at a time.
template <typename T, int G>
inline void values_heads(const float* scores, const float* inv_sum, const T* vp, const int64_t* row_slots, int64_t n,
                         int64_t num_kv_heads, int64_t h, int64_t d, float* o0, bool prefetch, int64_t c0, int64_t c1) {
  constexpr int W = value_pieces(G);
  int64_t j = 0;
  for (; j + kLanes * W <= d; j += kLanes * W)
    values_piece<T, G, W>(scores, inv_sum, vp, row_slots, n, num_kv_heads, h, d, j, o0, prefetch && j == 0, c0, c1);
  if constexpr (W > 2) {   // the rest two pieces at a time where it can (one piece: 4 fma chains a column at most)
    for (; j + kLanes * 2 <= d; j += kLanes * 2)
      values_piece<T, G, 2>(scores, inv_sum, vp, row_slots, n, num_kv_heads, h, d, j, o0, prefetch && j == 0, c0, c1);
  }
  for (; j < d; j += kLanes)
    values_piece<T, G, 1>(scores, inv_sum, vp, row_slots, n, num_kv_heads, h, d, j, o0, prefetch && j == 0, c0, c1);
}

// f(G) for G = count (1 .. 8) as a compile-time constant.
template <typename F>
inline void with_heads(int64_t count, const F& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

// f(h, first, count) for the pieces of query heads [q_begin, q_end): each within one KV head h, at most 8.
template <typename F>
inline void for_pieces(int64_t q_begin, int64_t q_end, int64_t group, const F& f) {
  for (int64_t q = q_begin; q < q_end;) {
    const int64_t h = q / group, count = std::min<int64_t>(8, std::min(q_end, (h + 1) * group) - q);
    f(h, q, count);
    q += count;
  }
}

// Within a task the KV heads take turns over chunks of this many columns (their rows lie side by side in
// the pool: a row read for one KV head brings its neighbours' lines too).
constexpr int64_t kScoreChunk = 32;

// Query heads [q_begin, q_end) of one row against its columns row_slots[0 .. n) (a segment): scores
// (scores [q_end - q_begin, n]), softmax, values, each head's floats as the plain run() computes them; the
// outputs at o (head q at o + q * d) divided by their sums where ``top`` is null, else their raw sums with
// each head's max and sum of exps at top[q - q_begin], total[q - q_begin]; ``fetch_v``: the scores pass
// prefetches the V rows into L2.
template <typename T>
void attend_span(const float* q_row, const T* kp, const T* vp, const int64_t* row_slots, int64_t n,
                 int64_t num_kv_heads, int64_t group, int64_t d, float fscale, int64_t q_begin, int64_t q_end,
                 float* scores, float* inv_sum, float* o, float* top, float* total, bool fetch_v) {
  const T* v_ahead = fetch_v ? vp : nullptr;
  const bool normalize = top == nullptr;
  for (int64_t c0 = 0; c0 < n; c0 += kScoreChunk) {
    const int64_t c1 = std::min(n, c0 + kScoreChunk);
    for_pieces(q_begin, q_end, group, [&](int64_t h, int64_t first, int64_t count) {
      with_heads(count, [&](auto heads) {
        constexpr int G = decltype(heads)::value;
        constexpr int TC = score_columns(G);
        const float* q0 = q_row + first * d;
        float* s = scores + (first - q_begin) * n;
        int64_t c = c0;
        for (; c + TC <= c1; c += TC) scores_tile<T, G, TC>(q0, kp, v_ahead, row_slots, c, n, num_kv_heads, h, d, fscale, s);
        for (; c < c1; ++c) scores_tile<T, G, 1>(q0, kp, v_ahead, row_slots, c, n, num_kv_heads, h, d, fscale, s);
      });
    });
  }
  for (int64_t g = 0; g < q_end - q_begin; ++g) {
    float top_g;
    const float sum = softmax_sum(scores + g * n, n, &top_g);
    inv_sum[g] = 1.0f / sum;
    if (!normalize) {
      top[g] = top_g;
      total[g] = sum;
    }
  }
  for (int64_t c0 = 0; c0 < n; c0 += kValueColumns) {
    const int64_t c1 = std::min(n, c0 + kValueColumns);
    bool prefetch = true;   // the first piece's first pass prefetches the chunk's V rows into L1
    for_pieces(q_begin, q_end, group, [&](int64_t h, int64_t first, int64_t count) {
      with_heads(count, [&](auto heads) {
        constexpr int G = decltype(heads)::value;
        constexpr int VG = value_heads(G);
        const int64_t g = first - q_begin;
        const float* inv = normalize ? inv_sum + g : nullptr;
        values_heads<T, VG>(scores + g * n, inv, vp, row_slots, n, num_kv_heads, h, d, o + first * d, prefetch, c0, c1);
        if constexpr (G > VG)
          values_heads<T, G - VG>(scores + (g + VG) * n, normalize ? inv + VG : nullptr, vp, row_slots, n, num_kv_heads,
                                  h, d, o + (first + VG) * d, false, c0, c1);
      });
      prefetch = false;
    });
  }
}

// Tasks of a row of n columns: its segments x ``parts`` parts of its heads (which heads a task takes
// changes no float), enough parts that ``threads`` threads have work where the segments are fewer.
inline int64_t head_parts(int64_t segments, int64_t num_heads, int64_t threads) {
  return std::min(num_heads, std::max<int64_t>(1, (threads + segments - 1) / segments));
}

inline int64_t row_plan(int64_t n, int64_t num_heads, int64_t threads, int64_t* parts) {
  const int64_t segments = row_segments(n);
  *parts = head_parts(segments, num_heads, threads);
  return segments * *parts;
}

// Task ``task`` of a row (segment task / parts, heads of part task % parts): q_row's heads at q_row
// (D floats each), outputs [H, D] at out, or partial results (partial_floats' layout) at partial.
template <typename T>
void attend_row_task(const float* q_row, const T* kp, const T* vp, const int64_t* row_slots, int64_t n,
                     int64_t num_kv_heads, int64_t num_heads, int64_t d, float fscale, int64_t parts, int64_t task,
                     float* out, float* partial) {
  const int64_t segments = row_segments(n), s = task / parts, part = task % parts;
  const int64_t q_begin = part * num_heads / parts, q_end = (part + 1) * num_heads / parts;
  if (q_begin == q_end) return;
  const int64_t c0 = s * kSegmentColumns, len = std::min(n, c0 + kSegmentColumns) - c0;
  thread_local std::vector<float> scores, inv_sum;
  if (static_cast<int64_t>(scores.size()) < (q_end - q_begin) * len) scores.resize((q_end - q_begin) * len);
  if (static_cast<int64_t>(inv_sum.size()) < q_end - q_begin) inv_sum.resize(q_end - q_begin);
  const int64_t group = num_heads / num_kv_heads;
  // V rows fetched into L2 by the scores pass, except for a lone segment split by heads (one short row):
  // there it cost 2-6% (one stream at 128-512 columns, Qwen2.5-Coder 0.5B, 2 threads, AMD Zen 3)
  const bool fetch_v = segments > 1 || parts == 1;
  // one segment: normalized outputs in place; more: the segment's raw sums, maxima and sums of exps
  float* tops = segments == 1 ? nullptr : partial + segments * num_heads * d + s * num_heads + q_begin;
  attend_span(q_row, kp, vp, row_slots + c0, len, num_kv_heads, group, d, fscale, q_begin, q_end, scores.data(),
              inv_sum.data(), segments == 1 ? out : partial + s * num_heads * d, tops,
              tops == nullptr ? nullptr : tops + segments * num_heads, fetch_v);
}

template <typename T>
void run_tiled(const float* qp, int64_t q_row, const T* kp, const T* vp, const int64_t* sp,
               const int64_t* np, float* op, int64_t b, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               int64_t columns, float fscale) {
  const std::vector<int64_t> offsets = partial_offsets(np, b, num_heads, d);
  // the calling thread's, kept (a megabyte at 32 x 4,096 columns of Qwen2.5-Coder 0.5B: mapped afresh and
  // zeroed on every layer's call otherwise; the tasks, on other threads, take its pointer, not the name)
  thread_local std::vector<float> kept;
  if (static_cast<int64_t>(kept.size()) < offsets[b]) kept.resize(offsets[b]);
  float* const partial = kept.data();
  // (row, segment) tasks, their heads in parts where the segments are fewer than the threads
  std::vector<int64_t> first_segment(b + 1, 0);
  for (int64_t i = 0; i < b; ++i) first_segment[i + 1] = first_segment[i] + row_segments(np[i]);
  const int64_t segments = first_segment[b];
  const int64_t parts = head_parts(segments, num_heads, at::get_num_threads());
  // One task at a time from a shared counter (servelm_parallel.h): the threads balance longer and shorter
  // contexts as they go, and a thread that loses its core to another process holds up one task, not a
  // share of the batch fixed up front.
  // A row of more than one segment is merged by the thread that ends its last task (no second parallel
  // region; the merge's floats are the same whichever thread runs it).
  std::vector<std::atomic<int64_t>> remaining(b);
  for (int64_t i = 0; i < b; ++i) remaining[i].store((first_segment[i + 1] - first_segment[i]) * parts);
  servelm_parallel::dynamic_for(segments * parts, segments * parts, [&](int64_t task, int64_t) {
    const int64_t segment = task / parts;
    const int64_t i = std::upper_bound(first_segment.begin(), first_segment.end(), segment) - first_segment.begin() - 1;
    attend_row_task(qp + i * q_row, kp, vp, sp + i * columns, np[i], num_kv_heads, num_heads, d, fscale, parts,
                    (segment - first_segment[i]) * parts + task % parts, op + i * num_heads * d,
                    partial + offsets[i]);
    if (offsets[i + 1] > offsets[i] && remaining[i].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_heads(np[i], partial + offsets[i], num_heads, d, 0, num_heads, op + i * num_heads * d);
  });
}

// The kernel over q rows at qp (row i at qp + i * q_row, its H heads' D floats one after another) into
// out [b, H, D] (float32, contiguous; zeros where not tiled: run() accumulates into it).
void attend_rows(const float* qp, int64_t q_row, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& slots, const torch::Tensor& spans, double scale, bool tiled,
                 float* op, int64_t b, int64_t num_heads, int64_t d) {
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() &&
              (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kBFloat16),
              "float32 or bfloat16 KV pool");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              spans.is_contiguous(), "contiguous pools, slots and spans");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && spans.scalar_type() == torch::kInt64 &&
              slots.dim() == 2 && slots.size(0) == b && spans.numel() == b, "slots [b, C], spans [b], int64");
  const int64_t num_kv_heads = k_cache.size(1), columns = slots.size(1);
  TORCH_CHECK(d % kLanes == 0 && k_cache.size(2) == d && v_cache.size(2) == d, "head_dim a multiple of the lanes");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads a multiple of KV heads");
  const float fscale = static_cast<float>(scale);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* np = spans.data_ptr<int64_t>();
  if (k_cache.dtype() == torch::kFloat32) {
    const float* kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    if (tiled) run_tiled(qp, q_row, kp, vp, sp, np, op, b, num_heads, num_kv_heads, d, columns, fscale);
    else run(qp, q_row, kp, vp, sp, np, op, b, num_heads, num_kv_heads, d, columns, fscale);
  } else {
    const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
    const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
    if (tiled) run_tiled(qp, q_row, kp, vp, sp, np, op, b, num_heads, num_kv_heads, d, columns, fscale);
    else run(qp, q_row, kp, vp, sp, np, op, b, num_heads, num_kv_heads, d, columns, fscale);
  }
}

// T rows of ``width`` elements (row i at source + i * row_bytes, its heads contiguous) into pool
// [slots, heads, D] (width = heads * D) at slot_mapping's rows, as pool.index_copy_(0, slot_mapping, rows)
// (the same dtype: a plain copy).
void write_rows(const char* source, int64_t num_rows, int64_t row_bytes, torch::Tensor& pool,
                const int64_t* slot_mapping) {
  const int64_t num_slots = pool.size(0);
  const int64_t bytes = pool.size(1) * pool.size(2) * static_cast<int64_t>(pool.element_size());
  auto* target = static_cast<char*>(pool.data_ptr());
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t slot = slot_mapping[i];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the pool's ", num_slots);
    std::memcpy(target + slot * bytes, source + i * row_bytes, bytes);
  }
}

// rows [T, heads, D] (a view: any row stride, heads one after another) into the pool, as write_rows.
void write_rows(const torch::Tensor& rows, torch::Tensor& pool, const int64_t* slot_mapping) {
  TORCH_CHECK(rows.dtype() == pool.dtype(), "K/V rows in the pool's dtype");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == pool.size(1) && rows.size(2) == pool.size(2) &&
              rows.stride(2) == 1 && rows.stride(1) == rows.size(2), "K/V rows [T, Hkv, D], each row's heads contiguous");
  write_rows(static_cast<const char*>(rows.data_ptr()), rows.size(0),
             rows.stride(0) * static_cast<int64_t>(rows.element_size()), pool, slot_mapping);
}

// The attention of q rows at qp (row stride q_row, H heads of D floats each) into a new [b, H * D]
// float32 tensor (zeroed where not tiled: run() accumulates into it).
torch::Tensor attend_into_new(const float* qp, int64_t q_row, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& spans,
                              double scale, bool tiled, int64_t b, int64_t num_heads, int64_t d) {
  auto out = torch::empty({b, num_heads * d}, k_cache.options().dtype(torch::kFloat32));
  if (!tiled) out.zero_();
  attend_rows(qp, q_row, k_cache, v_cache, slots, spans, scale, tiled, out.data_ptr<float>(), b, num_heads, d);
  return out;
}

}  // namespace

// q [b, H, D] float32; k_cache, v_cache [slots, Hkv, D] float32 or bfloat16; slots [b, C] int64
// (column c of sequence i); spans [b] int64 (valid columns of each sequence, >= 1); tiled: run_tiled
// (else run: the same figures bit for bit, slower). Returns float32 [b, H, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor spans, double scale, bool tiled) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "contiguous float32 q [b, H, D]");
  auto out = tiled ? torch::empty_like(q) : torch::zeros_like(q);
  const int64_t num_heads = q.size(1), d = q.size(2);
  attend_rows(q.data_ptr<float>(), num_heads * d, k_cache, v_cache, slots, spans, scale, tiled,
              out.data_ptr<float>(), q.size(0), num_heads, d);
  return out;
}

// One decode layer's attention in one call: k, v [T, Hkv, D] written into the pools at slot_mapping's
// slots [T] (as index_copy_), then decode_attention of q [T, H, D] over them. q, k, v are views of the
// QKV projection's rows (any row stride, each row's heads contiguous), q float32 (read in place) or
// bfloat16 (widened first: exact); k, v in the pools' dtype. Returns [T, H * D] in q's dtype (bf16:
// the float32 result rounded once, as .to() rounds it).
torch::Tensor write_and_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                               torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor slots,
                               torch::Tensor spans, double scale, bool tiled) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16),
              "q [T, H, D], float32 or bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == q.size(0) && k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "slot_mapping [T] int64, a slot per row of q, k, v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous pools");
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  write_rows(k, k_cache, slot_ptr);
  write_rows(v, v_cache, slot_ptr);
  const int64_t b = q.size(0), num_heads = q.size(1), d = q.size(2);
  if (q.scalar_type() == torch::kFloat32 && q.stride(2) == 1 && q.stride(1) == d) {
    return attend_into_new(q.data_ptr<float>(), q.stride(0), k_cache, v_cache, slots, spans, scale, tiled, b,
                           num_heads, d);
  }
  const auto q_float = q.to(torch::kFloat32).contiguous();
  auto out = attend_into_new(q_float.data_ptr<float>(), num_heads * d, k_cache, v_cache, slots, spans, scale, tiled,
                             b, num_heads, d);
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

// write_and_attend on a QKV projection's rows qkv [T, (H + 2 Hkv) * D] (rows contiguous, any row stride:
// q's H heads, then k's Hkv, then v's; D the pools'), without the q, k, v views: the same floats.
torch::Tensor write_and_attend_qkv(torch::Tensor qkv, int64_t num_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor slot_mapping, torch::Tensor slots, torch::Tensor spans, double scale,
                                   bool tiled) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
              (qkv.scalar_type() == torch::kFloat32 || qkv.scalar_type() == torch::kBFloat16),
              "qkv [T, (H + 2 Hkv) * D] with contiguous rows, float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.scalar_type() == qkv.scalar_type(), "contiguous pools [slots, Hkv, D] in qkv's dtype");
  const int64_t b = qkv.size(0), num_kv_heads = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(num_heads > 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv: [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == b, "slot_mapping [T] int64, a slot per row of qkv");
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  const int64_t element = static_cast<int64_t>(qkv.element_size()), row_bytes = qkv.stride(0) * element;
  const char* base = static_cast<const char*>(qkv.data_ptr());
  write_rows(base + num_heads * d * element, b, row_bytes, k_cache, slot_ptr);
  write_rows(base + (num_heads + num_kv_heads) * d * element, b, row_bytes, v_cache, slot_ptr);
  if (qkv.scalar_type() == torch::kFloat32) {
    return attend_into_new(qkv.data_ptr<float>(), qkv.stride(0), k_cache, v_cache, slots, spans, scale, tiled, b,
                           num_heads, d);
  }
  const auto q_float = qkv.narrow(1, 0, num_heads * d).to(torch::kFloat32).contiguous();
  return attend_into_new(q_float.data_ptr<float>(), num_heads * d, k_cache, v_cache, slots, spans, scale, tiled, b,
                         num_heads, d).to(qkv.scalar_type());
}

// The one-row functions the AVX2 block kernel's DecodeStack calls (servelm_row_attention.h), float32
// pools: what run_tiled computes for the row, in the same floats. No checks: the caller's (its pools,
// slots and spans are checked as attend_rows checks them).
const RowAttentionF32 kRowAttentionF32{&row_plan, &partial_floats, &attend_row_task<float>, &merge_heads};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a float32 or bf16 pool");
  m.def("write_and_attend", &write_and_attend, "K/V written into the pools, then the paged decode attention");
  m.def("write_and_attend_qkv", &write_and_attend_qkv, "write_and_attend on a QKV projection's rows",
        py::arg("qkv"), py::arg("num_heads"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("slots"), py::arg("spans"), py::arg("scale"), py::arg("tiled") = true);
  m.attr("ISA") = vec::kIsa;
  m.attr("LANES") = kLanes;
  m.attr("VALUE_COLUMNS") = kValueColumns;
  m.attr("SEGMENT_COLUMNS") = kSegmentColumns;
  m.attr("ROW_ATTENTION_F32") = py::capsule(const_cast<void*>(static_cast<const void*>(&kRowAttentionF32)),
                                             "servelm.row_attention_f32");
}
