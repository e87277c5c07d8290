// The one way the library splits host work over threads.
#pragma once

#include <cstdint>
#include <functional>

namespace lwo {

// Runs fn(begin, end) over [0, n) on at most `n_threads` threads (0: one per
// core; never more than 64), each given at least `min_part` items. With
// chunks_per_thread 1, one contiguous part per thread (the part a thread
// first-touches is the part it owns); with more, [0, n) is cut into that many
// chunks per thread, which the threads take in turn as they finish, so that a
// thread slowed by sharing its core (say with a host thread spinning in a
// CUDA synchronisation) holds up no one. Every part or chunk but the last is
// a multiple of `align` items. The calling thread works too; where a thread
// cannot be started its share runs there. Returns when every item is done.
// fn must not throw.
void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn,
                  uint32_t chunks_per_thread = 1);

}  // namespace lwo
