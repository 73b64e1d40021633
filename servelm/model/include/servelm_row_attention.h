// One decode row's paged attention over float32 pools, as paged_decode.cpp computes it, for a caller in
// another build (the AVX2 block kernel's DecodeStack): paged_decode.cpp exports a RowAttentionF32 in the
// capsule "servelm.row_attention_f32" (its module's ROW_ATTENTION_F32). Included with
// #include "servelm_row_attention.h"; any ISA.
//
// A row of n columns is cut into segments of a fixed number of columns (so its floats depend on n only,
// never on the threads or on the rows beside it); a segment's query heads may be split into parts, which
// changes no float. ``plan`` says how many tasks the row takes for ``threads`` threads and into how many
// parts each segment's heads are split; each task is ``task``; where the row has more than one segment
// (``partial_floats`` > 0), every task must end before ``merge`` runs, on any split of the heads.
#pragma once

#include <cstdint>

struct RowAttentionF32 {
  // Tasks of a row of n columns and num_heads query heads for ``threads`` threads; *parts: the parts
  // of each segment's heads (what ``task`` takes).
  int64_t (*plan)(int64_t n, int64_t num_heads, int64_t threads, int64_t* parts);
  // Floats of scratch the row's segments' partial results take (0: one segment, written in place).
  int64_t (*partial_floats)(int64_t n, int64_t num_heads, int64_t d);
  // Task ``task`` of ``plan``'s: q_row's num_heads heads (D floats each, one after another) against the
  // pools' rows at row_slots[0 .. n); outputs [num_heads, d] at out, or partial results at partial.
  void (*task)(const float* q_row, const float* kp, const float* vp, const int64_t* row_slots, int64_t n,
               int64_t num_kv_heads, int64_t num_heads, int64_t d, float scale, int64_t parts, int64_t task,
               float* out, float* partial);
  // Query heads [q_begin, q_end) of out from the segments' partial results (a row of more than one segment).
  void (*merge)(int64_t n, const float* partial, int64_t num_heads, int64_t d, int64_t q_begin, int64_t q_end,
                float* out);
};
