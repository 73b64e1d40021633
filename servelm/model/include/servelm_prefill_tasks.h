// The work of one causal prefill attention call, shared by the two kernels that compute it in place from
// the paged pool (prefill_attention.cpp: bf16; prefill_attention_f32.cpp: float32): the arguments'
// layout, the call's sequences, and its tasks (a task: one sequence's tile of queries against one KV head,
// with the key columns its queries see). Included by those kernels only (it needs torch/extension.h);
// cpp_kernel.py hashes it into every kernel's build key like every header here.
#pragma once

#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace servelm_prefill {

struct Sequence {
  int64_t row_start;    // first token row of its queries in q / out
  int64_t num_queries;
  int64_t start;        // position of its first query
  int64_t first;        // position of its column 0 in slots
  const int64_t* slots; // [columns] pool slot of each column
};

struct Task {
  int64_t sequence, kv_head, query;   // query: first query (offset in the sequence) of the tile
  int64_t column_begin, column_end;   // columns the tile reads
};

// What every task of a call reads besides its own tile: the tensors' strides (elements) and the mask.
struct Layout {
  int64_t q_token, q_head, k_slot, k_head, v_slot, v_head, o_token, o_head;
  int64_t window;   // 0: none
  float scale;
};

inline Layout layout_of(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& out, int64_t window, double scale) {
  return {q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
          out.stride(0), out.stride(1), window, float(scale)};
}

// q [T, H, D], pools [S, Hkv, D] / [S, Hkv, Dv], out [T, H, Dv], each with contiguous head rows; slots
// [b, columns] int64 (column c of sequence i is position plan[i, 3] + c); plan [b, 4] int64 rows:
// (row_start, num_queries, start, first). The dtypes are each kernel's to check.
inline void check_layout(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& slots, const torch::Tensor& plan, const torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3, "3-d q, pools, out");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && out.stride(2) == 1,
              "contiguous head rows");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.is_contiguous(), "slots [b, columns] int64");
  TORCH_CHECK(plan.scalar_type() == torch::kInt64 && plan.dim() == 2 && plan.size(1) == 4 && plan.is_contiguous() &&
              plan.size(0) == slots.size(0), "plan [b, 4] int64");
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && v_cache.size(1) == num_kv_heads,
              "query heads a multiple of KV heads");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && v_cache.size(0) == k_cache.size(0),
              "K's head_dim that of q, pools of as many slots");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == num_heads && out.size(2) == v_cache.size(2), "out [T, H, Dv]");
}

// The call's sequences, each plan row checked against q's rows and the slots' columns, and every slot its
// tasks read against the pool.
inline std::vector<Sequence> plan_sequences(const torch::Tensor& plan, const torch::Tensor& slots, int64_t q_rows,
                                            int64_t pool_slots, int64_t window) {
  const int64_t b = slots.size(0), columns = slots.size(1);
  const int64_t* pl = plan.data_ptr<int64_t>();
  std::vector<Sequence> sequences(b);
  for (int64_t i = 0; i < b; ++i) {
    Sequence& seq = sequences[i];
    seq = {pl[4 * i], pl[4 * i + 1], pl[4 * i + 2], pl[4 * i + 3], slots.data_ptr<int64_t>() + i * columns};
    TORCH_CHECK(seq.row_start >= 0 && seq.num_queries >= 0 && seq.row_start + seq.num_queries <= q_rows &&
                seq.start >= seq.first && seq.start + seq.num_queries - seq.first <= columns, "plan row ", i, " out of range");
    const int64_t used = seq.start + seq.num_queries - seq.first;
    for (int64_t c = window > 0 ? std::max<int64_t>(0, seq.start - window + 1 - seq.first) : 0; c < used; ++c)
      TORCH_CHECK(seq.slots[c] >= 0 && seq.slots[c] < pool_slots, "slot of sequence ", i, " column ", c, " out of the pool");
  }
  return sequences;
}

// Tiles of ``queries`` queries of every sequence times the KV heads, each reading the columns some query of
// it sees (causal; inside ``window`` where > 0); longest first, for threads that take them one at a time
// from a shared counter (so they finish together).
inline std::vector<Task> plan_tasks(const std::vector<Sequence>& sequences, int64_t num_kv_heads, int64_t queries,
                                    int64_t window) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < int64_t(sequences.size()); ++i) {
    const Sequence& seq = sequences[i];
    for (int64_t query = 0; query < seq.num_queries; query += queries) {
      const int64_t nq = std::min(queries, seq.num_queries - query);
      const int64_t low = seq.start + query, high = low + nq - 1;
      const int64_t begin = window > 0 ? std::max(seq.first, low - window + 1) : seq.first;
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({i, h, query, begin - seq.first, high + 1 - seq.first});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) {
    return x.column_end - x.column_begin > y.column_end - y.column_begin;
  });
  return tasks;
}

}  // namespace servelm_prefill
