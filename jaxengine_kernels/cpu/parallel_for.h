// The CPU kernels' one way of spreading work over XLA's intra-op threads (included by
// ragged_paged_attention.cc, packed_matmul.cc and block_matmul.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxengine_cpu {

// Runs work(i) for i in [0, n) on the calling thread and XLA's intra-op pool. Late helpers find
// the counter spent and return without touching anything but the shared counters.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F work) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto c = std::make_shared<Counters>();
  auto loop = [c, n, &work] {
    for (int64_t i; (i = c->next.fetch_add(1)) < n;) {
      work(i);
      c->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t h = 0; h < helpers; ++h)
    pool.Schedule([c, n, loop] {
      if (c->next.load() < n) loop();
    });
  loop();
  while (c->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxengine_cpu
