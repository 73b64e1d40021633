// Causal prefill attention of multi-token sequences, read in place from the paged bf16 KV pool, as
// flash-style tiles with AVX512-BF16 dot products (vdpbf16ps) and a float32 online softmax:
//   out[t, h] = softmax(scale * q[t, h] . K[c]) over the columns c that query t sees, weighted sum of V[c]
// (causal: key position <= query position; sliding: and key position > query position - window).
//
// Work: one task per (sequence, KV head, tile of Q queries: 16 where the group G is even, 32 where odd).
// The tile's rows are the G query heads sharing that KV head times its queries (row r = head * Q + query),
// so every K and V row read serves all G heads (GQA without expanding K/V). A task walks its key columns
// kKeys at a time, only those some query of the tile sees (the causal upper triangle and, on sliding
// layers, everything left of the window are never touched); only steps cut by the mask's edge compute a
// mask. Inside such an edge step, score blocks of 8 columns that no query of the tile sees and value pairs
// that no query of a 4-row block sees are skipped (their probabilities are exactly 0). Tasks are taken
// longest first from a shared counter by torch's OpenMP threads (the module is built with -fopenmp: the
// omp pragma of at::parallel_for is compiled here); a 512-token chunk of Gemma 3 (1 KV head) is 32 tasks.
//
// Layout: the tile's queries are packed once per task as bf16 pairs Qp[D/2][rows] (uint32: dims 2i,
// 2i+1 of one row; 16 rows per gather); a score block is 8 key columns x 32 rows in lanes: per pair of
// dims, 2 loads of Qp and 8 broadcasts of the key rows' pairs straight from the pool (no K copy).
// Scores S[column][row] take the online softmax with rows in lanes (max, exp and sums element-wise,
// no horizontal reductions); probabilities are rounded to bf16 and packed as pairs of columns
// Pp[kKeys/2][rows]. V is packed once per (sequence, KV head) as pairs of columns Vp[pair][Dv]; the
// output O[rows][Dv] float32 accumulates 4 rows x 64 dims per block (Vp loaded, Pp broadcast),
// rescaled by exp(old max - new max) per key step.
// Measured (Gemma 3 270M shapes, 1 thread, noisy shared machine): 400-450 GFLOPS of the ~545 that vdpbf16ps
// reaches in a bare score loop (benchmarks/prefill_attention.py); scores run at ~90% of that, P.V at ~80%
// (its 16 output accumulators are reloaded per key step: 64 keys per step measured ~5% faster than 32),
// softmax and packing ~6-9% of the time. A cheaper exp (integer exponent, degree 5) measured no faster.
//
// Numerics: q.k in float32 from bf16 products (exact) summed in dpbf16's order; softmax in float32 with exp
// as 2^x (degree-6 polynomial and scalef, about 1e-7 relative); probabilities rounded to bf16 before P.V (as the GEMM path rounds
// them); output divided by the float32 sum, rounded to bf16 once. Tolerance against float32 SDPA is
// stated in tests/unit/model/test_prefill_attention.py.
//
// Compiled at run time by servelm/model/attention/prefill_attention.py with AVX512-BF16 flags, only
// where /proc/cpuinfo has avx512_bf16; the Python side checks dtypes and shapes before calling.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "servelm_prefill_tasks.h"
#include "servelm_simd.h"

namespace {

using servelm_simd::exp2_16;

// Queries per task (times G query heads: the tile's rows, a multiple of 32 for score_block): 16 where G
// is even (twice the tasks of 32, so 2 threads split a 512-token chunk of one KV head into 32 tasks and the
// triangle and window edges waste half as much), 32 where G is odd.
constexpr int64_t kQueriesEvenGroup = 16;
constexpr int64_t kQueriesOddGroup = 32;
constexpr int64_t kKeys = 64;      // key columns per step of a task (64: half the O reloads of 32, ~5% faster)
constexpr int64_t kPackPairs = 64; // V column pairs packed per parallel work item

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Two float32 vectors rounded to bf16 (nearest even) and interleaved: lane i = (a[i], b[i]).
inline __m512i pack_pairs(__m512 a, __m512 b) {
  const __m256bh lo = _mm512_cvtneps_pbh(a), hi = _mm512_cvtneps_pbh(b);
  const __m512i lo32 = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(lo));
  const __m512i hi32 = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi));
  return _mm512_or_si512(lo32, _mm512_slli_epi32(hi32, 16));
}

inline uint16_t bf16_round(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return v != v ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

using servelm_prefill::Sequence;
using servelm_prefill::Task;

struct Shape : servelm_prefill::Layout {
  int64_t num_heads, group, d, dv, queries, rows;   // rows = group * queries
};

// Per-thread scratch of one task.
struct Scratch {
  std::vector<uint32_t> qp;    // [d/2][rows]
  std::vector<float> s;        // [kKeys][rows]
  std::vector<uint32_t> pp;    // [kKeys/2][rows]
  std::vector<float> o;        // [rows][dv]
  std::vector<float> m, l, alpha;        // [rows]
  std::vector<const uint32_t*> k_rows;   // [kKeys]
  std::vector<uint16_t> zeros;           // one zero row (columns past the context end)
  explicit Scratch(const Shape& sh)
      : qp(sh.d / 2 * sh.rows), s(kKeys * sh.rows), pp(kKeys / 2 * sh.rows), o(sh.rows * sh.dv), m(sh.rows),
        l(sh.rows), alpha(sh.rows), k_rows(kKeys), zeros(std::max(sh.d, sh.dv), 0) {}
};

// S[c][r..r+32] = Qp[.][r..r+32] . K[c] for 8 columns c0..c0+8.
inline void score_block(const uint32_t* qp, int64_t rows, int64_t d2, const uint32_t* const* k, float* s) {
  __m512 acc[8][2];
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d2; ++i) {
    const __m512bh a0 = as_bh(_mm512_loadu_si512(qp + i * rows));
    const __m512bh a1 = as_bh(_mm512_loadu_si512(qp + i * rows + 16));
    for (int j = 0; j < 8; ++j) {
      const __m512bh b = as_bh(_mm512_set1_epi32(int32_t(k[j][i])));
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a0, b);
      acc[j][1] = _mm512_dpbf16_ps(acc[j][1], a1, b);
    }
  }
  for (int j = 0; j < 8; ++j) {
    _mm512_storeu_ps(s + j * rows, acc[j][0]);
    _mm512_storeu_ps(s + j * rows + 16, acc[j][1]);
  }
}

// O[r..r+4][v..v+64] = alpha[r] * O[r][v..] + sum over column pairs [pair_begin, pair_end) of the step of
// Pp[pair][r] . Vp[pair][v..] (the caller leaves out pairs these 4 rows do not see: their P is exactly 0).
inline void value_block(const uint32_t* pp, const uint32_t* vp, int64_t rows, int64_t dv, const float* alpha,
                        int64_t pair_begin, int64_t pair_end, float* o) {
  __m512 acc[4][4];
  for (int i = 0; i < 4; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + i * dv + 16 * j), a);
  }
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = as_bh(_mm512_loadu_si512(vp + pair * dv + 16 * j));
    for (int i = 0; i < 4; ++i) {
      const __m512bh a = as_bh(_mm512_set1_epi32(int32_t(pp[pair * rows + i])));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + i * dv + 16 * j, acc[i][j]);
}

// Pairs [pair_begin, pair_end) of V of one (sequence, KV head) as bf16 pairs of columns: vp[pair][dv] = (V[2 pair][dv], V[2 pair + 1][dv]),
// zeros past the view's last column.
void pack_values(const Sequence& seq, int64_t kv_head, int64_t num_columns, int64_t pair_begin, int64_t pair_end,
                 const Shape& sh, const uint16_t* v, const uint16_t* zeros, uint32_t* vp) {
  for (int64_t pair = pair_begin; pair < std::min(pair_end, (num_columns + 1) / 2); ++pair) {
    const int64_t c = 2 * pair;
    const uint16_t* a = v + seq.slots[c] * sh.v_slot + kv_head * sh.v_head;
    const uint16_t* b = c + 1 < num_columns ? v + seq.slots[c + 1] * sh.v_slot + kv_head * sh.v_head : zeros;
    for (int64_t j = 0; j < sh.dv; j += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j)));
      _mm512_storeu_si512(vp + pair * sh.dv + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// One task; vp: its (sequence, KV head)'s packed V (pack_values).
void run_task(const Task& task, const Sequence& seq, const Shape& sh, const uint16_t* q, const uint16_t* k,
              const uint32_t* vp, uint16_t* out, Scratch& w) {
  const int64_t rows = sh.rows, d2 = sh.d / 2, dv = sh.dv, group = sh.group, kQueries = sh.queries;
  const int64_t nq = std::min(kQueries, seq.num_queries - task.query);
  const int64_t q_low = seq.start + task.query, q_high = q_low + nq - 1;   // positions
  // pack the tile's queries, 16 rows per gather (padding rows repeat the last query: same mask, never
  // fully hidden); a gather is 10x faster here than the scalar transpose's strided stores
  const uint16_t* q_tile = q + (seq.row_start + task.query) * sh.q_token + task.kv_head * group * sh.q_head;
  const __m512i lane16 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t r = 0; r < rows; r += 16) {
    const __m512i t = _mm512_min_epi32(_mm512_add_epi32(lane16, _mm512_set1_epi32(int32_t(r % kQueries))),
                                       _mm512_set1_epi32(int32_t(nq - 1)));
    const __m512i offsets = _mm512_add_epi32(_mm512_mullo_epi32(t, _mm512_set1_epi32(int32_t(sh.q_token / 2))),
                                             _mm512_set1_epi32(int32_t(r / kQueries * sh.q_head / 2)));
    for (int64_t i = 0; i < d2; ++i)
      _mm512_storeu_si512(w.qp.data() + i * rows + r, _mm512_i32gather_epi32(offsets, q_tile + 2 * i, 4));
  }
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const float log2_scale = sh.scale * 1.44269504088896341f;   // exp(scale x) = 2^(x scale log2 e)
  const __m512 cl = _mm512_set1_ps(log2_scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // columns start even: packed V pairs are aligned to the view's column 0 (an extra column is masked)
  for (int64_t c0 = task.column_begin & ~int64_t(1); c0 < task.column_end; c0 += kKeys) {
    const int64_t valid = std::min(kKeys, task.column_end - c0);
    for (int64_t c = 0; c < kKeys; ++c) {
      const uint16_t* row = c < valid ? k + seq.slots[c0 + c] * sh.k_slot + task.kv_head * sh.k_head : w.zeros.data();
      w.k_rows[c] = reinterpret_cast<const uint32_t*>(row);
    }
    const int64_t k_first = seq.first + c0;   // position of the step's column 0
    // a block of 8 columns is computed only where some query of the tile sees one of them (the rest of an
    // edge step is masked below, whatever its scores hold); a 32-row score block holds every query of the tile
    const int64_t last_seen = std::min(valid - 1, q_high - k_first);
    const int64_t first_seen = sh.window == 0 ? 0 : std::max<int64_t>(0, q_low - sh.window + 1 - k_first);
    for (int64_t c = first_seen & ~int64_t(7); c <= last_seen; c += 8)
      for (int64_t r = 0; r < rows; r += 32)
        score_block(w.qp.data() + r, rows, d2, w.k_rows.data() + c, w.s.data() + c * rows + r);
    const bool whole = valid == kKeys && k_first + kKeys - 1 <= q_low &&
                       (sh.window == 0 || k_first > q_high - sh.window);
    for (int64_t r = 0; r < rows; r += 16) {
      const __m512 old = _mm512_loadu_ps(w.m.data() + r);
      __m512 top = old;
      if (whole) {
        for (int64_t c = 0; c < kKeys; ++c) top = _mm512_max_ps(top, _mm512_loadu_ps(w.s.data() + c * rows + r));
      } else {
        // positions of these 16 rows' queries, relative to k_first (rows r.. are queries r % kQueries.. of one head)
        const __m512i t = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(r % kQueries))),
                                           _mm512_set1_epi32(int32_t(nq - 1)));
        const __m512i q_pos = _mm512_add_epi32(t, _mm512_set1_epi32(int32_t(q_low - k_first)));
        const __m512i q_edge = _mm512_sub_epi32(q_pos, _mm512_set1_epi32(int32_t(sh.window)));
        for (int64_t c = 0; c < kKeys; ++c) {
          float* sc = w.s.data() + c * rows + r;
          const __m512i cv = _mm512_set1_epi32(int32_t(c));
          __mmask16 seen = _mm512_cmple_epi32_mask(cv, q_pos);
          if (sh.window != 0) seen &= _mm512_cmpgt_epi32_mask(cv, q_edge);
          if (c >= valid) seen = 0;
          const __m512 x = _mm512_mask_blend_ps(seen, neg_inf, _mm512_loadu_ps(sc));
          _mm512_storeu_ps(sc, x);
          top = _mm512_max_ps(top, x);
        }
      }
      // rows that have seen nothing yet keep -inf: 0 is their reference (all their p are 0)
      const __m512 ref = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(top, neg_inf, _CMP_EQ_OQ), top, _mm512_setzero_ps());
      const __m512 ref_scaled = _mm512_mul_ps(ref, cl);
      const __mmask16 had = _mm512_cmp_ps_mask(old, neg_inf, _CMP_NEQ_OQ);
      const __m512 a = _mm512_maskz_mov_ps(had, exp2_16(_mm512_fmsub_ps(old, cl, ref_scaled)));
      _mm512_storeu_ps(w.alpha.data() + r, a);
      _mm512_storeu_ps(w.m.data() + r, top);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < kKeys / 2; ++i) {
        const __m512 x0 = _mm512_loadu_ps(w.s.data() + (2 * i) * rows + r);
        const __m512 x1 = _mm512_loadu_ps(w.s.data() + (2 * i + 1) * rows + r);
        __m512 p0 = exp2_16(_mm512_fmsub_ps(x0, cl, ref_scaled));
        __m512 p1 = exp2_16(_mm512_fmsub_ps(x1, cl, ref_scaled));
        if (!whole) {
          p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, neg_inf, _CMP_NEQ_OQ), p0);
          p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, neg_inf, _CMP_NEQ_OQ), p1);
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_storeu_si512(w.pp.data() + i * rows + r, pack_pairs(p0, p1));
      }
      _mm512_storeu_ps(w.l.data() + r, _mm512_fmadd_ps(_mm512_loadu_ps(w.l.data() + r), a, sum));
    }
    const uint32_t* v_step = vp + (c0 / 2) * dv;
    for (int64_t r = 0; r < rows; r += 4) {
      // rows r..r+3 are queries t..t+3 of one head: the pairs holding a column one of them sees
      const int64_t t = r % kQueries;
      const int64_t hi = std::min(valid - 1, q_low + std::min(t + 3, nq - 1) - k_first);
      const int64_t lo = sh.window == 0 ? 0 : std::max<int64_t>(0, q_low + std::min(t, nq - 1) - sh.window + 1 - k_first);
      const int64_t pair_begin = lo / 2, pair_end = hi < lo ? pair_begin : hi / 2 + 1;
      for (int64_t j = 0; j < dv; j += 64)
        value_block(w.pp.data() + r, v_step + j, rows, dv, w.alpha.data() + r, pair_begin, pair_end,
                    w.o.data() + r * dv + j);
    }
  }
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t head = task.kv_head * group + hh;
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t r = hh * kQueries + t;
      const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
      uint16_t* dst = out + (seq.row_start + task.query + t) * sh.o_token + head * sh.o_head;
      for (int64_t j = 0; j < dv; j += 16) {
        const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * dv + j), inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), reinterpret_cast<const __m256i&>(rounded));
      }
    }
  }
}

// q [T, H, D], pools [S, Hkv, D] / [S, Hkv, Dv] (bf16); slots [b, columns] int64 (column c of sequence
// i is position plan[i, 3] + c); plan [b, 4] int64 rows: (row_start, num_queries, start, first);
// writes out [T, H, Dv] (bf16) at every sequence's rows.
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                       torch::Tensor plan, int64_t window, double scale, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
              v_cache.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16, "bf16 q, pools, out");
  servelm_prefill::check_layout(q, k_cache, v_cache, slots, plan, out);
  Shape sh;
  sh.num_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(1);
  sh.group = sh.num_heads / num_kv_heads;
  sh.d = q.size(2);
  sh.dv = v_cache.size(2);
  TORCH_CHECK(sh.d % 16 == 0 && sh.dv % 64 == 0, "head_dim % 16, V's % 64");
  TORCH_CHECK(scale > 0, "a positive scale");
  TORCH_CHECK(q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0 && q.stride(0) * q.size(0) < (int64_t(1) << 31),
              "q's strides even, its rows within 2^31 elements (32-bit gathers of bf16 pairs)");
  sh.queries = sh.group % 2 == 0 ? kQueriesEvenGroup : kQueriesOddGroup;
  sh.rows = sh.group * sh.queries;
  static_cast<servelm_prefill::Layout&>(sh) = servelm_prefill::layout_of(q, k_cache, v_cache, out, window, scale);
  const int64_t b = slots.size(0);
  const std::vector<Sequence> sequences =
      servelm_prefill::plan_sequences(plan, slots, q.size(0), k_cache.size(0), window);
  const std::vector<Task> tasks = servelm_prefill::plan_tasks(sequences, num_kv_heads, sh.queries, window);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // V of every (sequence, KV head) packed once, shared by that pair's tasks; each region holds its
  // sequence's own columns plus kKeys zero columns (a task's last step reads up to kKeys past its end)
  std::vector<int64_t> offsets(b + 1, 0);
  for (int64_t i = 0; i < b; ++i) {
    const Sequence& seq = sequences[i];
    const int64_t pairs = (seq.start + seq.num_queries - seq.first + 1) / 2 + kKeys / 2;
    offsets[i + 1] = offsets[i] + num_kv_heads * pairs * sh.dv;
  }
  std::vector<uint32_t> packed(static_cast<size_t>(offsets[b]));
  const std::vector<uint16_t> zeros(sh.dv, 0);
  auto region = [&](int64_t i, int64_t kv_head) {
    return packed.data() + offsets[i] + kv_head * (offsets[i + 1] - offsets[i]) / num_kv_heads;
  };
  // work items of kPackPairs pairs, so both threads pack (one KV head: one region)
  std::vector<std::array<int64_t, 3>> packs;   // (sequence * num_kv_heads + kv head, first pair, end pair)
  for (int64_t i = 0; i < b * num_kv_heads; ++i) {
    const Sequence& seq = sequences[i / num_kv_heads];
    const int64_t pairs = (seq.start + seq.num_queries - seq.first + 1) / 2;
    for (int64_t pair = 0; pair < pairs; pair += kPackPairs) packs.push_back({i, pair, pair + kPackPairs});
  }
  // One parallel region: each thread takes pack items, then waits (spinning) until every item is packed
  // and takes tasks, both from shared counters. A thread that another process keeps off its core joins
  // late and finds less left; only the region's closing barrier waits for it (a second region, for the
  // packing alone, would wait for it twice).
  std::atomic<int64_t> next_pack{0}, packed_items{0}, next{0};
  const int64_t num_packs = int64_t(packs.size()), num_tasks = int64_t(tasks.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t p = next_pack++; p < num_packs; p = next_pack++) {
      const int64_t i = packs[p][0];
      const Sequence& seq = sequences[i / num_kv_heads];
      pack_values(seq, i % num_kv_heads, seq.start + seq.num_queries - seq.first, packs[p][1], packs[p][2], sh, vp,
                  zeros.data(), region(i / num_kv_heads, i % num_kv_heads));
      packed_items.fetch_add(1, std::memory_order_release);
    }
    while (packed_items.load(std::memory_order_acquire) < num_packs) _mm_pause();
    Scratch scratch(sh);
    for (int64_t i = next++; i < num_tasks; i = next++)
      run_task(tasks[i], sequences[tasks[i].sequence], sh, qp, kp, region(tasks[i].sequence, tasks[i].kv_head),
               op, scratch);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention,
        "causal / sliding-window prefill attention over the paged bf16 pool (AVX512-BF16 tiles)");
}
