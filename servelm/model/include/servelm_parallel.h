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

// fn(begin, end) for ``count`` units of [0, n) as even as can be (unit u: [u n / count, (u + 1) n /
// count)), each taken by one of torch's threads from a shared counter in increasing order; a single
// unit or thread runs inline.
template <typename F>
inline void dynamic_for(int64_t n, int64_t count, const F& fn) {
  if (n <= 0) return;
  count = std::max<int64_t>(1, std::min(count, n));
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), count);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < count;
         u = next.fetch_add(1, std::memory_order_relaxed))
      fn(u * n / count, (u + 1) * n / count);
  });
}

// How many units ``dynamic_for`` should cut ``n`` items into: about ``per_thread`` a thread, of at
// least ``least`` items (fewer units then, as at::parallel_for's grain) and at most ``most`` (most
// <= 0: no limit), and a multiple of the threads, so that on a quiet machine every thread gets the
// same share (three units on two threads made one thread do two: a third slower than halves).
inline int64_t units_for(int64_t n, int64_t per_thread, int64_t least, int64_t most = 0) {
  if (n <= 0) return 1;
  const int64_t threads = std::max(1, at::get_num_threads());
  least = std::max<int64_t>(1, least);
  int64_t count = per_thread * threads;
  if (most > 0) count = std::max(count, (n + most - 1) / most);
  count = std::max<int64_t>(1, std::min(count, (n + least - 1) / least));
  if (count > threads) count = (count + threads - 1) / threads * threads;
  return std::min(count, n);
}

}  // namespace servelm_parallel
