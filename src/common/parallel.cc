#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "dtype.h"

namespace lwo {

void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn, uint32_t chunks_per_thread) {
  if (n == 0) return;
  uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint64_t parts = std::min<uint32_t>(n_threads ? n_threads : hw, 64);
  min_part = std::max<uint64_t>(min_part, 1);
  align = std::max<uint64_t>(align, 1);
  parts = std::min(parts, (n + min_part - 1) / min_part);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  // Chunks: `parts` of them (static), or chunks_per_thread times as many,
  // taken in turn from a shared counter.
  const uint64_t want = parts * std::max<uint32_t>(chunks_per_thread, 1);
  const uint64_t chunk = align_up((n + want - 1) / want, align);
  const uint64_t n_chunks = (n + chunk - 1) / chunk;
  std::atomic<uint64_t> next{0};
  auto work = [&](uint64_t first) {
    if (chunks_per_thread <= 1) {  // one part per thread: chunk `first`
      const uint64_t b = std::min(n, chunk * first), e = std::min(n, chunk * (first + 1));
      if (b < e) fn(b, e);
      return;
    }
    for (uint64_t k = next.fetch_add(1); k < n_chunks; k = next.fetch_add(1))
      fn(chunk * k, std::min(n, chunk * (k + 1)));
  };
  std::vector<std::thread> threads;
  threads.reserve(parts);
  for (uint64_t i = 1; i < parts; ++i) {
    if (chunks_per_thread <= 1 && chunk * i >= n) break;
    try {
      threads.emplace_back(work, i);
    } catch (...) {  // no thread: do it here
      work(i);
    }
  }
  work(0);
  for (auto& t : threads) t.join();
}

}  // namespace lwo
