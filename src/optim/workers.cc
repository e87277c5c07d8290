#include "workers.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "src/common/dtype.h"

namespace lwo {
namespace optim {

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

Workers::Workers(uint32_t n_threads) {
  const std::vector<NumaNode> nodes = numa_nodes();
  uint32_t n_cpus = 0;
  for (const NumaNode& n : nodes) n_cpus += static_cast<uint32_t>(n.cpus.size());
  uint32_t n = std::min<uint32_t>(n_threads ? n_threads : std::max(1u, n_cpus), 64);
  n_nodes_ = static_cast<uint32_t>(nodes.size());
  // Threads to nodes in proportion to their CPUs: thread t goes to the node
  // that holds CPU floor(t * n_cpus / n) in the nodes' order.
  node_of_.resize(n);
  std::vector<size_t> node_index(n);
  for (uint32_t t = 0; t < n; ++t) {
    uint64_t c = uint64_t(t) * n_cpus / n;
    size_t k = 0;
    while (k + 1 < nodes.size() && c >= nodes[k].cpus.size()) c -= nodes[k++].cpus.size();
    node_index[t] = k;
    node_of_[t] = nodes[k].id;
  }
  auto bind = [&](pthread_t th, size_t k) {
    if (nodes.size() < 2) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : nodes[k].cpus)
      if (c < CPU_SETSIZE) CPU_SET(c, &set);
    pthread_setaffinity_np(th, sizeof set, &set);  // best effort: a refusal changes no result
  };
  for (uint32_t t = 1; t < n; ++t) {
    try {
      threads_.emplace_back([this, t] { loop(t); });
      bind(threads_.back().native_handle(), node_index[t]);
    } catch (...) {
      break;  // fewer threads: their parts go to the others
    }
  }
  node_of_.resize(threads_.size() + 1);
}

Workers::~Workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Workers::run(uint64_t n, uint64_t align, uint64_t min_part,
                  const std::function<void(uint64_t, uint64_t)>& fn) {
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    part_ = part;
    active_ = active;
    remaining_ = active - 1;
    ++gen_;
  }
  cv_.notify_all();
  fn(0, std::min(n, part));
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return remaining_ == 0; });
  fn_ = nullptr;
}

void Workers::loop(uint32_t t) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(uint64_t, uint64_t)>* fn;
    uint64_t b, e;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      if (t >= active_) continue;
      fn = fn_;
      b = std::min(n_, part_ * t);
      e = std::min(n_, part_ * (t + 1));
    }
    if (b < e) (*fn)(b, e);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--remaining_ == 0) done_cv_.notify_all();
    }
  }
}

}  // namespace optim
}  // namespace lwo
