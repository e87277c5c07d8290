#include "parallel.h"

#include <algorithm>

#include "dtype.h"
#include "thread_pool.h"

namespace lwo {

void parallel_for(ThreadPool& pool, uint64_t n, uint32_t n_threads, uint64_t min_part,
                  uint64_t align, const std::function<void(uint64_t, uint64_t)>& fn,
                  uint32_t chunks_per_thread) {
  if (n == 0) return;
  uint64_t parts = std::min<uint32_t>(n_threads ? n_threads : pool.size(), 64);
  min_part = std::max<uint64_t>(min_part, 1);
  align = std::max<uint64_t>(align, 1);
  parts = std::min(parts, (n + min_part - 1) / min_part);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  // Chunks: `parts` of them (static), or chunks_per_thread times as many,
  // taken in turn.
  const uint64_t want = parts * std::max<uint32_t>(chunks_per_thread, 1);
  const uint64_t chunk = align_up((n + want - 1) / want, align);
  const uint64_t n_chunks = (n + chunk - 1) / chunk;
  if (chunks_per_thread <= 1) {  // one part per thread: chunk p on slot_of(p, n_chunks)
    pool.run(static_cast<uint32_t>(n_chunks),
             [&](uint32_t p) { fn(chunk * p, std::min(n, chunk * (p + 1))); });
    return;
  }
  pool.share(static_cast<uint32_t>(parts), n_chunks,
             [&](uint64_t k) { fn(chunk * k, std::min(n, chunk * (k + 1))); });
}

void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn,
                  uint32_t chunks_per_thread) {
  parallel_for(ThreadPool::process(), n, n_threads, min_part, align, fn, chunks_per_thread);
}

}  // namespace lwo
