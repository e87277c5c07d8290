// The one way the library splits host work over threads.
#pragma once

#include <cstdint>
#include <functional>

namespace lwo {

// Runs fn(begin, end) over [0, n) in contiguous parts, one thread each: at
// most `n_threads` parts (0: one per core; never more than 64), each at least
// `min_part` items and, but for the last, a multiple of `align` items. One
// part runs on the calling thread; where a thread cannot be started its part
// runs there too. Returns when every part is done. fn must not throw.
void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn);

}  // namespace lwo
