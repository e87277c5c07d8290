// The optimizer's host threads: a fixed set of threads that live as long as
// their owner, placed on the machine's NUMA nodes where it has more than one
// (read from /sys/devices/system/node; no library), each of which always
// takes the same part of every range it is given. The part a thread first
// touches (the masters and state, filled by the same partition) is then the
// part it updates on every step: its pages lie on the thread's node.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lwo {
namespace optim {

// The NUMA nodes of this machine with their CPUs (one node holding every
// CPU where /sys says nothing, or there is no such file).
struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
};
std::vector<NumaNode> numa_nodes();
// Parses a /sys cpulist ("0-3,8,10-11"); an unreadable list is empty.
std::vector<int> parse_cpulist(const std::string& text);

class Workers {
 public:
  // n_threads 0: one per CPU (at most 64). Where there is more than one node
  // the threads are spread over the nodes in proportion to their CPUs and
  // each is bound to its node's CPUs; on one node they are left to the
  // scheduler.
  explicit Workers(uint32_t n_threads);
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  uint32_t size() const { return static_cast<uint32_t>(threads_.size()) + 1; }
  uint32_t n_nodes() const { return n_nodes_; }
  // The node of thread t (0 = the calling thread's share).
  int node_of(uint32_t t) const { return node_of_[t]; }

  // fn(b, e) over [0, n): thread t (the caller is thread 0) takes part t, the
  // parts contiguous and every boundary a multiple of `align` items; ranges
  // below `min_part` items per thread use fewer threads (the first ones).
  // Returns when all is done. One run at a time (callers serialise). fn must
  // not throw.
  void run(uint64_t n, uint64_t align, uint64_t min_part,
           const std::function<void(uint64_t, uint64_t)>& fn);

 private:
  void loop(uint32_t t);

  std::vector<std::thread> threads_;
  std::vector<int> node_of_;
  uint32_t n_nodes_ = 1;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  uint64_t gen_ = 0;
  uint32_t remaining_ = 0;
  bool stop_ = false;
  // The current run.
  const std::function<void(uint64_t, uint64_t)>* fn_ = nullptr;
  uint64_t n_ = 0, part_ = 0;
  uint32_t active_ = 0;
};

}  // namespace optim
}  // namespace lwo
