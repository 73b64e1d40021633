// Work sharing for servelm's C++ kernels (included with #include "servelm_parallel.h"; any ISA).
//
// at::parallel_for gives each thread an equal share of the items up front. On a machine where other
// processes run beside the engine (the HTTP front end, a benchmark client, anything else on the
// cores), a thread whose core is taken for a while holds up the whole call: its share waits while
// the other threads idle at the join. ``dynamic_for`` instead lets torch's threads take units of
// work from a shared counter, so the threads that keep their cores take the rest. Which thread
// computes a unit never changes what it computes: callers keep each unit's arithmetic independent.
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace servelm_parallel {

// fn(begin, end) for the units [u * unit, min(n, (u + 1) * unit)) of [0, n), each taken by one of
// torch's threads from a shared counter in increasing order; one unit or one thread runs inline.
template <typename F>
inline void dynamic_for(int64_t n, int64_t unit, const F& fn) {
  if (n <= 0) return;
  unit = std::max<int64_t>(1, unit);
  const int64_t units = (n + unit - 1) / unit;
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), units);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed))
      fn(u * unit, std::min(n, (u + 1) * unit));
  });
}

// The unit for ``n`` items split in about ``per_thread`` units per thread, at least ``least`` items
// and at most ``most`` (most <= 0: no upper bound).
inline int64_t unit_for(int64_t n, int64_t per_thread, int64_t least, int64_t most = 0) {
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t unit = (n + per_thread * threads - 1) / (per_thread * threads);
  if (most > 0) unit = std::min(unit, most);
  return std::max<int64_t>({unit, least, 1});
}

}  // namespace servelm_parallel
