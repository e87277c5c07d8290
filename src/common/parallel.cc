#include "parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "dtype.h"

namespace lwo {

void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn) {
  if (n == 0) return;
  uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint64_t parts = std::min<uint32_t>(n_threads ? n_threads : hw, 64);
  min_part = std::max<uint64_t>(min_part, 1);
  parts = std::min(parts, (n + min_part - 1) / min_part);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  uint64_t chunk = align_up((n + parts - 1) / parts, std::max<uint64_t>(align, 1));
  std::vector<std::thread> threads;
  threads.reserve(parts);
  for (uint64_t i = 1; i < parts; ++i) {
    uint64_t b = std::min(n, chunk * i), e = std::min(n, chunk * (i + 1));
    if (b >= e) break;
    try {
      threads.emplace_back(fn, b, e);
    } catch (...) {  // no thread: do it here
      fn(b, e);
    }
  }
  fn(0, std::min(n, chunk));
  for (auto& t : threads) t.join();
}

}  // namespace lwo
