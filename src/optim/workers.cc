#include "workers.h"

#include <algorithm>

#include "src/common/dtype.h"

namespace lwo {
namespace optim {

Workers::Workers(ThreadPool& pool, uint32_t n_threads)
    : pool_(&pool), n_(std::min<uint32_t>(n_threads ? n_threads : pool.size(), 64)) {}

void Workers::run(uint64_t n, uint64_t align, uint64_t min_part,
                  const std::function<void(uint64_t, uint64_t)>& fn) const {
  if (n == 0) return;
  align = std::max<uint64_t>(align, 1);
  min_part = std::max<uint64_t>(min_part, 1);
  uint32_t active = static_cast<uint32_t>(
      std::min<uint64_t>(size(), std::max<uint64_t>(1, n / min_part)));
  const uint64_t part = align_up((n + active - 1) / active, align);
  active = static_cast<uint32_t>(std::min<uint64_t>(active, (n + part - 1) / part));
  if (active <= 1) {
    fn(0, n);
    return;
  }
  // Placed as parts of size(): part t on the same slot whatever `active` is.
  pool_->run(
      active,
      [&](uint32_t t) {
        const uint64_t b = std::min(n, part * t), e = std::min(n, part * (t + 1));
        if (b < e) fn(b, e);
      },
      size());
}

}  // namespace optim
}  // namespace lwo
