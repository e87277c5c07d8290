// The one way the library splits a range of host work over threads: the
// host thread pool's (thread_pool.h).
#pragma once

#include <cstdint>
#include <functional>

namespace lwo {

class ThreadPool;

// Runs fn(begin, end) over [0, n) in at most `n_threads` parts (0: one per
// slot of the pool; never more than 64), each of at least `min_part` items,
// on `pool`'s threads and the calling thread. With chunks_per_thread 1, one
// contiguous part per thread, part p on the pool's slot slot_of(p, parts)
// (the part a thread first-touches is the part it owns); with more, [0, n)
// is cut into that many chunks per thread, which the threads take in turn
// as they finish, so that a thread slowed by sharing its core (say with a
// host thread spinning in a CUDA synchronisation) or by other work of the
// pool holds up no one. Every part or chunk but the last is a multiple of
// `align` items. Returns when every item is done; where fn throws, the rest
// still runs and the first exception is rethrown then. Called from inside a
// task of the pool (a nested call), the parts run on the calling thread.
void parallel_for(ThreadPool& pool, uint64_t n, uint32_t n_threads, uint64_t min_part,
                  uint64_t align, const std::function<void(uint64_t, uint64_t)>& fn,
                  uint32_t chunks_per_thread = 1);
// The same on the process's pool (ThreadPool::process()).
void parallel_for(uint64_t n, uint32_t n_threads, uint64_t min_part, uint64_t align,
                  const std::function<void(uint64_t, uint64_t)>& fn,
                  uint32_t chunks_per_thread = 1);

}  // namespace lwo
