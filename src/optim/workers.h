// The optimizer's share of the host thread pool (src/common/thread_pool.h):
// a fixed number of parts, part t of every range it is given always run on
// the same slot of the pool, so on the same thread and NUMA node. The part a
// thread first touches (the masters and state, filled by the same
// partition) is then the part it updates on every step: its pages lie on the
// thread's node.
#pragma once

#include <cstdint>
#include <functional>

#include "src/common/thread_pool.h"

namespace lwo {
namespace optim {

class Workers {
 public:
  // n_threads parts (0: one per slot of the pool; at most 64), placed on the
  // pool's slots by ThreadPool::slot_of(t, n_threads): where there are fewer
  // slots than parts, a slot runs several of them in turn.
  Workers(ThreadPool& pool, uint32_t n_threads);
  // On the process's pool.
  explicit Workers(uint32_t n_threads) : Workers(ThreadPool::process(), n_threads) {}

  uint32_t size() const { return n_; }
  uint32_t n_nodes() const { return pool_->n_nodes(); }
  // The node of part t's thread (part 0 is the calling thread's).
  int node_of(uint32_t t) const { return pool_->node_of(pool_->slot_of(t, n_)); }
  ThreadPool& pool() const { return *pool_; }

  // fn(b, e) over [0, n): part t (the caller's is part 0) is the t-th, the
  // parts contiguous and every boundary a multiple of `align` items; ranges
  // below `min_part` items per part use fewer parts (the first ones).
  // Returns when all is done; runs from several threads may be in flight at
  // once. Where fn throws, the first exception is rethrown once all is done.
  void run(uint64_t n, uint64_t align, uint64_t min_part,
           const std::function<void(uint64_t, uint64_t)>& fn) const;

 private:
  ThreadPool* pool_;
  uint32_t n_;
};

}  // namespace optim
}  // namespace lwo
