// Work sharing for the XLA:CPU kernels (*.cc): items run on the calling thread and on
// XLA's intra-op thread pool, claimed one at a time, so a core the host has slowed or taken
// away runs fewer of them.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace akv {

// Calls item(i) once for every i in [0, n) and returns when all calls have returned. The
// claim counters are shared with the workers and owned by whoever finishes last: a worker
// that starts after the call returned finds nothing left to claim and never calls item.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n,
                         const std::function<void(int64_t)>& item) {
  struct Claims {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* item = nullptr;
    void run() {
      for (;;) {
        const int64_t i = next.fetch_add(1);
        if (i >= n) return;
        (*item)(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (n <= 0) return;
  auto claims = std::make_shared<Claims>();
  claims->n = n;
  claims->item = &item;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([claims] { claims->run(); });
  claims->run();
  while (claims->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace akv
