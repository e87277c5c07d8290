// The library's host threads: one pool of persistent threads, placed on the
// machine's NUMA nodes where it has more than one (read from
// /sys/devices/system/node; no library), that every piece of host work runs
// on: pinned pool fills, the staged sources' packing, gradient addition,
// host quantization and the optimizer's updates (parallel_for, parallel.h;
// optim::Workers). Long-lived threads that wait for work of their own (the
// optimizer's dispatcher) are started here too (HostThread).
//
// The pool has size() slots: slot 0 is whichever thread calls in (it always
// works on its own call), slots 1.. are the pool's threads. Each call is
// cut into parts or items, placed on the slots, and returns when all of them
// are done; calls from several threads at once share the threads (each
// thread's queue runs in order). A call made from inside a task of a pool
// runs all of its parts on the calling thread, in order (the threads never
// wait for one another, so nested calls cannot deadlock). A part that throws
// does not stop the others; the call rethrows the first exception once every
// part is done.
//
// HostThread and ThreadPool are the only C++ names liblwo.so exports
// (bindings/c/lwo.map): the program and testkit/ run their host work and
// their waiting threads on the process's pool, the one the library's
// engines use, rather than on threads of their own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lwo {

// The NUMA nodes of this machine with their CPUs (one node holding every
// CPU where /sys says nothing, or there is no such file).
struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
};
std::vector<NumaNode> numa_nodes();
// Parses a /sys cpulist ("0-3,8,10-11"); an unreadable list is empty.
std::vector<int> parse_cpulist(const std::string& text);

// A long-lived thread started by ThreadPool::start; joined by join() or when
// destroyed (its function must have been told to return by then).
class __attribute__((visibility("default"))) HostThread {
 public:
  HostThread() = default;
  HostThread(HostThread&&) noexcept = default;
  HostThread& operator=(HostThread&& o) noexcept;
  ~HostThread() { join(); }
  void join();

 private:
  friend class ThreadPool;
  std::thread thread_;
};

class __attribute__((visibility("default"))) ThreadPool {
 public:
  // n_slots 0: one per CPU; at most 64. Where there is more than one node
  // the threads are spread over the nodes in proportion to their CPUs (slot
  // s goes to the node that holds CPU floor(s * n_cpus / n_slots) in the
  // nodes' order) and each is bound to its node's CPUs; on one node they are
  // left to the scheduler. A thread that cannot be started leaves the pool
  // smaller.
  explicit ThreadPool(uint32_t n_slots);
  // Runs what is queued, then joins the threads. No call may be in flight.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process's pool, one slot per CPU: made on first use, never
  // destroyed (its threads idle at exit). Every engine holds it
  // (Engine::threads) and host calls without one use it (parallel_for), so a
  // process has one set of host threads however many engines it holds. In a
  // child forked from the process the pool's threads do not exist: its calls
  // run on the calling thread.
  static ThreadPool& process();

  uint32_t size() const { return static_cast<uint32_t>(node_of_.size()); }
  uint32_t n_nodes() const { return n_nodes_; }
  // The node of slot s (slot 0, the caller, is bound to none: the first).
  int node_of(uint32_t s) const { return node_of_[s]; }
  // The slot of part p of `of` parts: floor(p * size() / of), so that the
  // parts of a call are spread over the slots (and the nodes) alike
  // whatever their number, and part 0 is the caller's.
  uint32_t slot_of(uint32_t p, uint32_t of) const {
    return static_cast<uint32_t>(uint64_t(p) * size() / of);
  }

  // fn(p) for p in [0, n_parts), part p on slot slot_of(p, spread) (spread
  // 0: n_parts), so that a caller that places its parts by a fixed
  // `spread` has part p on the same thread, and node, on every call.
  // Returns when every part is done.
  void run(uint32_t n_parts, const std::function<void(uint32_t)>& fn, uint32_t spread = 0);
  // fn(i) for i in [0, n_items), the items taken in turn by the caller and
  // up to n_takers - 1 of the pool's threads as each finishes its last, so
  // that a thread slowed (by other work, or a core it shares) holds up no
  // one: returns when every item is done, without waiting for a thread that
  // came too late to take one.
  void share(uint32_t n_takers, uint64_t n_items, const std::function<void(uint64_t)>& fn);

  // A thread of its own running fn, for work that waits (not a slot).
  HostThread start(std::function<void()> fn);

 private:
  struct Job;
  struct Task {
    std::shared_ptr<Job> job;
    uint32_t part = 0;  // run: the part
    uint32_t slot = 0;
  };
  struct Slot;
  void loop(Slot& me);
  bool inline_only() const;
  void post(std::vector<Task>& tasks);  // each task to its slot's queue

  std::vector<std::unique_ptr<Slot>> slots_;  // slots_[s - 1] is slot s
  std::vector<int> node_of_;
  uint32_t n_nodes_ = 1;
  int pid_ = 0;  // the process that started the threads
  std::mutex mu_;  // the queues and stop_
  bool stop_ = false;
};

}  // namespace lwo
