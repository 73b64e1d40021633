// Causal prefill attention of multi-token sequences in float32, read in place from the paged KV pool
// (float32, or bf16 rows widened per key step: a float32 model's opt-in --kv-cache-dtype bfloat16), as
// flash-style tiles on FMA vectors (the float32 sibling of prefill_attention.cpp, which needs AVX512-BF16
// and bf16 queries):
//   out[t, h] = softmax(scale * q[t, h] . K[c]) over the columns c that query t sees, weighted sum of V[c]
// (causal: key position <= query position; sliding: and key position > query position - window).
//
// Work: one task per (sequence, KV head, tile of kQueries queries). The tile's rows are the G query heads
// sharing that KV head times its queries (row r = head * kQueries + query), so every K and V row read
// serves all G heads (GQA without expanding K/V). A task walks its key columns kKeys at a time, only those
// some query of the tile sees (the causal upper triangle and, on sliding layers, everything left of the
// window are never touched); only steps cut by the mask's edge compute a mask, and inside them score
// blocks of kScoreColumns columns that no query of the tile sees, and value columns that no query of a
// kValueRows-row block sees, are skipped (their probabilities are exactly 0). Tasks are taken longest
// first from a shared counter by torch's OpenMP threads.
//
// Layout: the tile's queries, times the scale, are packed once per task transposed, Qt[D][rows]; a score
// block is kScoreColumns key columns x kScoreVectors vectors of rows (rows in lanes): per dim, the rows'
// vectors loaded and each column's value broadcast straight from the pool row (no K copy). Scores
// S[column][row] take the online softmax with rows in lanes (max, exp and sums element-wise, no
// horizontal reductions) and become the probabilities in place. The output O[rows][Dv] accumulates
// kValueRows rows x kValueVectors vectors per block: each column's V vectors loaded from the pool row,
// each row's probability broadcast; rescaled by exp(old max - new max) per key step.
//
// Numerics: float32 throughout; exp is servelm_vec.h's exp_normal (Cephes' polynomial, ~1 ulp; inputs
// clamped at -87, where the exact subnormal scaling of exp_lanes measured 6% of the kernel's time at
// head_dim 64); each output row is computed by one task, its columns in order: the same floats whatever
// the threads or the other sequences of the call. Against float64 attention,
// tests/unit/model/test_prefill_attention.py.
//
// Measured (AMD EPYC Zen 3 VM, AVX2, 2 threads; Qwen2.5-Coder 0.5B's 14/2 heads x 64, a fresh prompt):
// 3.9 ms a layer at 512 tokens and 211 at 4,096 against torch's SDPA over the gathered context 7.2 and
// 292 (142 GFLOP/s of useful work at 4,096, of a ~180 float32 peak); Gemma 3 270M's 4/1 x 256: 4.9 / 220
// against 6.5 / 270. Inlined into the task, the value tile lost two accumulators to the stack (gcc kept
// loop constants in registers): 46 -> 65 GFLOP/s at 1 thread once the tiles were their own functions.
// 32 or 128 key columns a step, rows outermost in the score loop, or a 3 x 4 value tile: no faster.
//
// Written over servelm_vec.h; prefill_attention.py builds it with AVX2 and FMA (8 lanes, 16 registers:
// the register tiles below are sized for those), which AVX-512 CPUs run too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "servelm_prefill_tasks.h"
#include "servelm_vec.h"

namespace {

namespace vec = servelm_vec::vec;
using servelm_vec::exp_normal;
using servelm_vec::kLanes;

// Score tile: kScoreColumns columns x kScoreVectors vectors of rows (4 x 3 = 12 accumulators, 3 query
// loads and 4 broadcasts a dim: the 16 ymm registers).
constexpr int64_t kScoreColumns = 4;
constexpr int64_t kScoreVectors = 3;
// Value tile: kValueRows rows x kValueVectors output vectors (6 x 2 = 12 accumulators, 2 V loads and 6
// broadcasts a column).
constexpr int64_t kValueRows = 6;
constexpr int64_t kValueVectors = 2;
// Queries per task: a multiple of a score tile's rows (so a tile's rows, G x kQueries, are whole score
// tiles whatever G) and of kValueRows (a value tile's rows are consecutive queries of one head).
constexpr int64_t kQueries = kScoreVectors * kLanes;
static_assert(kQueries % kValueRows == 0 && kQueries % kLanes == 0, "tile sizes");
constexpr int64_t kKeys = 64;   // key columns per step of a task
static_assert(kKeys % kScoreColumns == 0, "whole score tiles per step");

using servelm_prefill::Sequence;
using servelm_prefill::Task;

struct Shape : servelm_prefill::Layout {
  int64_t group, d, dv, rows;   // rows = group * kQueries
};

// Per-thread scratch of one task.
struct Scratch {
  std::vector<float> qt;       // [d][rows]
  std::vector<float> s;        // [kKeys][rows]: scores, then probabilities
  std::vector<float> o;        // [rows][dv]
  std::vector<float> m, l, alpha;        // [rows]
  std::vector<const float*> k_rows, v_rows;   // [kKeys]
  std::vector<float> zeros;              // one zero row (columns past the task's end)
  std::vector<float> k_wide, v_wide;     // [kKeys][d], [kKeys][dv]: a bf16 pool's rows of the step, widened
  explicit Scratch(const Shape& sh, bool widen)
      : qt(sh.d * sh.rows), s(kKeys * sh.rows), o(sh.rows * sh.dv), m(sh.rows), l(sh.rows), alpha(sh.rows),
        k_rows(kKeys), v_rows(kKeys), zeros(std::max(sh.d, sh.dv), 0.f), k_wide(widen ? kKeys * sh.d : 0),
        v_wide(widen ? kKeys * sh.dv : 0) {}
};

// S[c][r..] = Qt[.][r..] . K[c] for kScoreColumns columns and kScoreVectors vectors of rows.
__attribute__((noinline)) void score_block(const float* qt, int64_t rows, int64_t d, const float* const* k, float* s) {
  vec::F acc[kScoreColumns][kScoreVectors];
  for (auto& column : acc)
    for (auto& a : column) a = vec::zero();
  for (int64_t i = 0; i < d; ++i) {
    vec::F a[kScoreVectors];
    for (int64_t v = 0; v < kScoreVectors; ++v) a[v] = vec::load(qt + i * rows + v * kLanes);
    for (int64_t j = 0; j < kScoreColumns; ++j) {
      const vec::F b = vec::set1(k[j][i]);
      for (int64_t v = 0; v < kScoreVectors; ++v) acc[j][v] = vec::fmadd(a[v], b, acc[j][v]);
    }
  }
  for (int64_t j = 0; j < kScoreColumns; ++j)
    for (int64_t v = 0; v < kScoreVectors; ++v) vec::store(s + j * rows + v * kLanes, acc[j][v]);
}

// O[r..r+kValueRows][dims] = alpha[r] * O[r][dims] + sum over columns [begin, end) of P[c][r] V[c][dims],
// dims = kValueVectors vectors from ``v_offset`` (the caller leaves out columns these rows do not see:
// their P is exactly 0).
__attribute__((noinline)) void value_block(const float* p, int64_t rows, const float* const* v, int64_t v_offset, const float* alpha,
                        int64_t begin, int64_t end, float* o, int64_t dv) {
  vec::F acc[kValueRows][kValueVectors];
  for (int64_t i = 0; i < kValueRows; ++i) {
    const vec::F a = vec::set1(alpha[i]);
    for (int64_t j = 0; j < kValueVectors; ++j) acc[i][j] = vec::mul(vec::load(o + i * dv + j * kLanes), a);
  }
  for (int64_t c = begin; c < end; ++c) {
    vec::F b[kValueVectors];
    for (int64_t j = 0; j < kValueVectors; ++j) b[j] = vec::load(v[c] + v_offset + j * kLanes);
    for (int64_t i = 0; i < kValueRows; ++i) {
      const vec::F a = vec::set1(p[c * rows + i]);
      for (int64_t j = 0; j < kValueVectors; ++j) acc[i][j] = vec::fmadd(a, b[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < kValueRows; ++i)
    for (int64_t j = 0; j < kValueVectors; ++j) vec::store(o + i * dv + j * kLanes, acc[i][j]);
}

// Row ``row`` of a pool as float32: a float32 pool's own row, a bf16 pool's widened into ``wide`` (exact).
inline const float* pool_row(const float* row, int64_t, float*) { return row; }
inline const float* pool_row(const uint16_t* row, int64_t n, float* wide) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) vec::store(wide + j, vec::load(row + j));
  for (; j < n; ++j) {
    const uint32_t bits = uint32_t(row[j]) << 16;
    std::memcpy(wide + j, &bits, 4);
  }
  return wide;
}

// One task over a pool of T (float: float32; uint16_t: bf16's bits).
template <typename T>
void run_task(const Task& task, const Sequence& seq, const Shape& sh, const float* q, const T* k, const T* v,
              float* out, Scratch& w) {
  const int64_t rows = sh.rows, d = sh.d, dv = sh.dv, group = sh.group;
  const int64_t nq = std::min(kQueries, seq.num_queries - task.query);
  const int64_t q_low = seq.start + task.query, q_high = q_low + nq - 1;   // positions
  // the tile's queries, scaled, transposed (padding rows repeat the last query: same mask, never fully hidden)
  for (int64_t hh = 0; hh < group; ++hh)
    for (int64_t t = 0; t < kQueries; ++t) {
      const float* src = q + (seq.row_start + task.query + std::min(t, nq - 1)) * sh.q_token +
                         (task.kv_head * group + hh) * sh.q_head;
      float* dst = w.qt.data() + hh * kQueries + t;
      for (int64_t i = 0; i < d; ++i) dst[i * rows] = src[i] * sh.scale;
    }
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const vec::F neg_inf = vec::set1(-std::numeric_limits<float>::infinity());
  for (int64_t c0 = task.column_begin; c0 < task.column_end; c0 += kKeys) {
    const int64_t valid = std::min(kKeys, task.column_end - c0);
    for (int64_t c = 0; c < kKeys; ++c) {
      const bool in = c < valid;
      w.k_rows[c] = in ? pool_row(k + seq.slots[c0 + c] * sh.k_slot + task.kv_head * sh.k_head, d,
                                  w.k_wide.data() + c * d)
                       : w.zeros.data();
      w.v_rows[c] = in ? pool_row(v + seq.slots[c0 + c] * sh.v_slot + task.kv_head * sh.v_head, dv,
                                  w.v_wide.data() + c * dv)
                       : w.zeros.data();
    }
    const int64_t k_first = seq.first + c0;   // position of the step's column 0
    // a score tile is computed only where some query of the task sees one of its columns (the rest of an
    // edge step is masked below, whatever its scores hold)
    const int64_t last_seen = std::min(valid - 1, q_high - k_first);
    const int64_t first_seen = sh.window == 0 ? 0 : std::max<int64_t>(0, q_low - sh.window + 1 - k_first);
    for (int64_t c = first_seen / kScoreColumns * kScoreColumns; c <= last_seen; c += kScoreColumns)
      for (int64_t r = 0; r < rows; r += kScoreVectors * kLanes)
        score_block(w.qt.data() + r, rows, d, w.k_rows.data() + c, w.s.data() + c * rows + r);
    const bool whole = valid == kKeys && k_first + kKeys - 1 <= q_low &&
                       (sh.window == 0 || k_first > q_high - sh.window);
    for (int64_t r = 0; r < rows; r += kLanes) {
      const vec::F old = vec::load(w.m.data() + r);
      vec::F top = old;
      if (whole) {
        for (int64_t c = 0; c < kKeys; ++c) top = vec::max(top, vec::load(w.s.data() + c * rows + r));
      } else {
        // positions of these rows' queries relative to k_first (rows r.. are queries r % kQueries.. of one
        // head), as floats (exact: positions are far below 2^24); column c is seen where c <= position
        // (and c > position - window)
        alignas(64) float position[kLanes];
        for (int64_t lane = 0; lane < kLanes; ++lane)
          position[lane] = float(q_low - k_first + std::min(r % kQueries + lane, nq - 1));
        const vec::F q_pos = vec::load(position), q_edge = vec::sub(q_pos, vec::set1(float(sh.window)));
        for (int64_t c = 0; c < kKeys; ++c) {
          float* sc = w.s.data() + c * rows + r;
          vec::F x = neg_inf;
          if (c < valid) {
            const vec::F column = vec::set1(float(c));
            vec::Mask seen = vec::less_equal(column, q_pos);
            if (sh.window != 0) seen = vec::both(seen, vec::greater(column, q_edge));
            x = vec::blend(neg_inf, vec::load(sc), seen);
          }
          vec::store(sc, x);
          top = vec::max(top, x);
        }
      }
      // rows that have seen nothing yet keep -inf: 0 is their reference (all their p are 0)
      const vec::F ref = vec::blend(top, vec::zero(), vec::equal(top, neg_inf));
      const vec::F a = vec::blend(exp_normal(vec::sub(old, ref)), vec::zero(), vec::equal(old, neg_inf));
      vec::store(w.alpha.data() + r, a);
      vec::store(w.m.data() + r, top);
      vec::F sum = vec::zero();
      for (int64_t c = 0; c < kKeys; ++c) {
        float* sc = w.s.data() + c * rows + r;
        const vec::F x = vec::load(sc);
        vec::F p = exp_normal(vec::sub(x, ref));
        if (!whole) p = vec::blend(p, vec::zero(), vec::equal(x, neg_inf));
        vec::store(sc, p);
        sum = vec::add(sum, p);
      }
      vec::store(w.l.data() + r, vec::fmadd(vec::load(w.l.data() + r), a, sum));
    }
    for (int64_t r = 0; r < rows; r += kValueRows) {
      // rows r..r+kValueRows-1 are queries t.. of one head: the columns one of them sees
      const int64_t t = r % kQueries;
      const int64_t hi = std::min(valid - 1, q_low + std::min(t + kValueRows - 1, nq - 1) - k_first);
      const int64_t lo = sh.window == 0 ? 0
                                        : std::max<int64_t>(0, q_low + std::min(t, nq - 1) - sh.window + 1 - k_first);
      const int64_t end = hi < lo ? lo : hi + 1;
      for (int64_t j = 0; j < dv; j += kValueVectors * kLanes)
        value_block(w.s.data() + r, rows, w.v_rows.data(), j, w.alpha.data() + r, lo, end, w.o.data() + r * dv + j, dv);
    }
  }
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t head = task.kv_head * group + hh;
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t r = hh * kQueries + t;
      const vec::F inv = vec::set1(1.f / w.l[r]);
      float* dst = out + (seq.row_start + task.query + t) * sh.o_token + head * sh.o_head;
      for (int64_t j = 0; j < dv; j += kLanes) vec::store(dst + j, vec::mul(vec::load(w.o.data() + r * dv + j), inv));
    }
  }
}

// q [T, H, D], pools [S, Hkv, D] / [S, Hkv, Dv] (float32); slots [b, columns] int64 (column c of sequence
// i is position plan[i, 3] + c); plan [b, 4] int64 rows: (row_start, num_queries, start, first);
// writes out [T, H, Dv] (float32) at every sequence's rows.
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                       torch::Tensor plan, int64_t window, double scale, torch::Tensor out) {
  const auto pool_dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 &&
              (pool_dtype == torch::kFloat32 || pool_dtype == torch::kBFloat16) && v_cache.scalar_type() == pool_dtype,
              "float32 q and out, float32 or bf16 pools");
  servelm_prefill::check_layout(q, k_cache, v_cache, slots, plan, out);
  const int64_t num_kv_heads = k_cache.size(1);
  Shape sh;
  sh.group = q.size(1) / num_kv_heads;
  sh.d = q.size(2);
  sh.dv = v_cache.size(2);
  TORCH_CHECK(sh.d > 0 && sh.dv > 0 && sh.dv % (kValueVectors * kLanes) == 0, "V's head_dim a multiple of ",
              kValueVectors * kLanes);
  TORCH_CHECK(scale > 0, "a positive scale");
  sh.rows = sh.group * kQueries;
  static_cast<servelm_prefill::Layout&>(sh) = servelm_prefill::layout_of(q, k_cache, v_cache, out, window, scale);
  const std::vector<Sequence> sequences =
      servelm_prefill::plan_sequences(plan, slots, q.size(0), k_cache.size(0), window);
  const std::vector<Task> tasks = servelm_prefill::plan_tasks(sequences, num_kv_heads, kQueries, window);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool bf16 = pool_dtype == torch::kBFloat16;
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = int64_t(tasks.size());
  if (num_tasks == 0) return;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(sh, bf16);
    for (int64_t i = next++; i < num_tasks; i = next++) {
      const Task& task = tasks[i];
      if (bf16)
        run_task(task, sequences[task.sequence], sh, qp, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                 reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), op, scratch);
      else
        run_task(task, sequences[task.sequence], sh, qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), op,
                 scratch);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention,
        "causal / sliding-window float32 prefill attention over the paged float32 or bf16 pool (FMA tiles)");
  m.attr("QUERIES") = kQueries;
  m.attr("VALUE_LANES") = kValueVectors * kLanes;
}
