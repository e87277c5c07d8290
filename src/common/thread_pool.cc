#include "thread_pool.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <fstream>
#include <sstream>

namespace lwo {

std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty() || item == "\n") continue;
    char* end = nullptr;
    long a = std::strtol(item.c_str(), &end, 10);
    if (end == item.c_str() || a < 0) return {};
    long b = a;
    if (*end == '-') {
      const char* s = end + 1;
      b = std::strtol(s, &end, 10);
      if (end == s || b < a) return {};
    }
    if (*end != '\0' && *end != '\n') return {};
    for (long c = a; c <= b && c < 65536; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

std::vector<NumaNode> numa_nodes() {
  std::vector<NumaNode> nodes;
  if (DIR* d = opendir("/sys/devices/system/node")) {
    while (dirent* e = readdir(d)) {
      int id = 0;
      if (std::sscanf(e->d_name, "node%d", &id) != 1) continue;
      std::ifstream f(std::string("/sys/devices/system/node/") + e->d_name + "/cpulist");
      std::string text;
      std::getline(f, text);
      NumaNode n;
      n.id = id;
      n.cpus = parse_cpulist(text);
      if (!n.cpus.empty()) nodes.push_back(n);  // memory-only nodes hold no threads
    }
    closedir(d);
  }
  std::sort(nodes.begin(), nodes.end(), [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  if (nodes.empty()) {
    NumaNode n;
    for (unsigned c = 0; c < std::max(1u, std::thread::hardware_concurrency()); ++c)
      n.cpus.push_back(static_cast<int>(c));
    nodes.push_back(n);
  }
  return nodes;
}

// ---- HostThread ----

HostThread& HostThread::operator=(HostThread&& o) noexcept {
  if (this != &o) {
    join();
    thread_ = std::move(o.thread_);
  }
  return *this;
}

void HostThread::join() {
  if (thread_.joinable()) thread_.join();
}

// ---- ThreadPool ----

namespace {
// Set while a thread of a pool runs a task: its own calls run inline.
thread_local bool t_in_task = false;
}  // namespace

// One call: its parts (run) or items (share), and what is left of them.
struct ThreadPool::Job {
  const std::function<void(uint32_t)>* part_fn = nullptr;  // run
  const std::function<void(uint64_t)>* item_fn = nullptr;  // share
  uint64_t n_items = 0;
  std::atomic<uint64_t> next{0};  // share: the next item to take
  std::atomic<uint64_t> left{0};  // parts or items not yet done
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;  // the first thrown

  void failed() {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = std::current_exception();
  }
  void done(uint64_t k) {
    if (left.fetch_sub(k) == k) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
  void part(uint32_t p) {
    try {
      (*part_fn)(p);
    } catch (...) {
      failed();
    }
  }
  // Takes items until none is left. item_fn is read only with an item
  // taken: a thread that comes after the last touches nothing of the call.
  void take() {
    uint64_t n = 0;
    for (uint64_t k = next.fetch_add(1); k < n_items; k = next.fetch_add(1), ++n) {
      try {
        (*item_fn)(k);
      } catch (...) {
        failed();
      }
    }
    if (n) done(n);
  }
  void wait_and_rethrow() {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return left.load() == 0; });
    }
    if (error) std::rethrow_exception(error);
  }
};

struct ThreadPool::Slot {
  std::deque<Task> queue;  // under the pool's mu_
  std::condition_variable cv;
  std::thread thread;
};

ThreadPool::ThreadPool(uint32_t n_slots) : pid_(static_cast<int>(getpid())) {
  const std::vector<NumaNode> nodes = numa_nodes();
  uint32_t n_cpus = 0;
  for (const NumaNode& n : nodes) n_cpus += static_cast<uint32_t>(n.cpus.size());
  const uint32_t n = std::min<uint32_t>(n_slots ? n_slots : std::max(1u, n_cpus), 64);
  n_nodes_ = static_cast<uint32_t>(nodes.size());
  node_of_.resize(n);
  std::vector<size_t> node_index(n);
  for (uint32_t s = 0; s < n; ++s) {
    uint64_t c = uint64_t(s) * n_cpus / n;
    size_t k = 0;
    while (k + 1 < nodes.size() && c >= nodes[k].cpus.size()) c -= nodes[k++].cpus.size();
    node_index[s] = k;
    node_of_[s] = nodes[k].id;
  }
  auto bind = [&](pthread_t th, size_t k) {
    if (nodes.size() < 2) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : nodes[k].cpus)
      if (c < CPU_SETSIZE) CPU_SET(c, &set);
    pthread_setaffinity_np(th, sizeof set, &set);  // best effort: a refusal changes no result
  };
  for (uint32_t s = 1; s < n; ++s) {
    try {
      slots_.push_back(std::make_unique<Slot>());
      Slot& slot = *slots_.back();
      slot.thread = std::thread([this, &slot] { loop(slot); });
      bind(slot.thread.native_handle(), node_index[s]);
    } catch (...) {
      if (slots_.size() == s && !slots_.back()->thread.joinable()) slots_.pop_back();
      break;  // fewer slots: the calls' parts go to the others
    }
  }
  node_of_.resize(slots_.size() + 1);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  for (auto& s : slots_) s->cv.notify_all();
  for (auto& s : slots_) s->thread.join();
}

ThreadPool& ThreadPool::process() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

void ThreadPool::loop(Slot& me) {
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      me.cv.wait(lock, [&] { return stop_ || !me.queue.empty(); });
      if (me.queue.empty()) return;  // stopped, and all that was queued is done
      t = std::move(me.queue.front());
      me.queue.pop_front();
    }
    t_in_task = true;
    if (t.job->part_fn) {
      t.job->part(t.part);
      t.job->done(1);
    } else {
      t.job->take();
    }
    t_in_task = false;
  }
}

bool ThreadPool::inline_only() const {
  return slots_.empty() || t_in_task || static_cast<int>(getpid()) != pid_;
}

void ThreadPool::post(std::vector<Task>& tasks) {
  if (tasks.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Task& t : tasks) slots_[t.slot - 1]->queue.push_back(t);
  }
  for (Task& t : tasks) slots_[t.slot - 1]->cv.notify_one();
}

void ThreadPool::run(uint32_t n_parts, const std::function<void(uint32_t)>& fn, uint32_t spread) {
  if (n_parts == 0) return;
  spread = std::max(spread, n_parts);
  const bool here = inline_only();
  auto job = std::make_shared<Job>();
  job->part_fn = &fn;
  std::vector<Task> tasks;
  if (!here)
    for (uint32_t p = 1; p < n_parts; ++p)
      if (const uint32_t s = slot_of(p, spread)) tasks.push_back({job, p, s});
  job->left = tasks.size();
  post(tasks);
  for (uint32_t p = 0; p < n_parts; ++p)
    if (here || slot_of(p, spread) == 0) job->part(p);
  job->wait_and_rethrow();
}

void ThreadPool::share(uint32_t n_takers, uint64_t n_items,
                       const std::function<void(uint64_t)>& fn) {
  if (n_items == 0) return;
  uint32_t takers = static_cast<uint32_t>(std::min<uint64_t>({n_takers, n_items, size()}));
  if (inline_only()) takers = 1;
  auto job = std::make_shared<Job>();
  job->item_fn = &fn;
  job->n_items = n_items;
  job->left = n_items;
  std::vector<Task> tasks;
  for (uint32_t t = 1; t < takers; ++t) tasks.push_back({job, 0, slot_of(t, takers)});
  post(tasks);
  job->take();
  job->wait_and_rethrow();
}

HostThread ThreadPool::start(std::function<void()> fn) {
  HostThread h;
  h.thread_ = std::thread(std::move(fn));
  return h;
}

}  // namespace lwo
