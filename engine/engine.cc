#include "engine.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cstdio>

#include "src/common/error.h"
#include "src/compute/compute.h"

namespace lwo {

Engine::Engine(std::unique_ptr<Backend> backend, int device)
    : gpu_(std::move(backend)), device_(device), threads_(ThreadPool::process()) {
  int prev = gpu_->get_device();
  gpu_->set_device(device_);
  try {
    h2d_ = gpu_->stream_create();
    d2h_ = gpu_->stream_create();
    collective_stream_ = gpu_->stream_create();
  } catch (...) {
    gpu_->stream_destroy(h2d_);
    gpu_->stream_destroy(d2h_);
    gpu_->set_device(prev);
    throw;
  }
  gpu_->set_device(prev);
  const char* env = std::getenv("LWO_CHECK_COLLECTIVES");
  check_collectives_ = env && env[0] && std::strcmp(env, "0") != 0;
  const char* heuristic = std::getenv("LWO_HEURISTIC_GEMM");
  if (heuristic && heuristic[0] && std::strcmp(heuristic, "0") != 0) tune_gemms_ = false;
  const char* checking = std::getenv("LWO_CHECKING");
  checking_ = checking && checking[0] && std::strcmp(checking, "0") != 0;
}

Engine::~Engine() {
  compute_.reset();  // its workspaces belong to the callers' streams
  try {
    DeviceScope scope(*this);
    gpu_->stream_sync(h2d_);
    gpu_->stream_sync(d2h_);
    gpu_->stream_sync(collective_stream_);
    for (auto& kv : checks_) {
      gpu_->device_free(kv.second.dev);
      gpu_->host_free_pinned(kv.second.host);
    }
  } catch (...) {
  }
  gpu_->stream_destroy(h2d_);
  gpu_->stream_destroy(d2h_);
  gpu_->stream_destroy(collective_stream_);
}

void Engine::check() {
  check_not_capturing("checking the engine's streams");
  DeviceScope scope(*this);
  gpu_->stream_check(h2d_);
  gpu_->stream_check(d2h_);
  gpu_->stream_check(collective_stream_);
}

Compute& Engine::compute() {
  std::lock_guard<std::mutex> lock(compute_mu_);
  if (!compute_) {
    compute_ = std::make_unique<Compute>(device_, tune_gemms_);
    Compute::MemoryHooks hooks;
    hooks.charge = [this](uint64_t bytes) {
      std::string what = strf("a %llu-byte compute workspace", static_cast<unsigned long long>(bytes));
      return charge(MemUse::Workspace, bytes, 1, what.c_str());
    };
    hooks.uncharge = [this](uint64_t charged) { uncharge(MemUse::Workspace, charged); };
    compute_->set_memory_hooks(std::move(hooks));
  }
  return *compute_;
}

void Engine::check_destroyable() const {
  int n = n_pools.load();
  if (n > 0)
    fail(LWO_ERR_BUSY, "engine on device %d still has %d pool%s", device_, n, n == 1 ? "" : "s");
}

// ---- device memory budget ----

const char* mem_use_name(MemUse u) {
  switch (u) {
    case MemUse::Slots: return "ring slots";
    case MemUse::Resident: return "resident layers";
    case MemUse::Grads: return "gradient staging";
    case MemUse::Workspace: return "compute workspaces";
    case MemUse::Other: return "other";
  }
  return "?";
}

void Engine::set_budget(uint64_t limit) {
  std::lock_guard<std::mutex> lock(budget_mu_);
  uint64_t held = 0;
  for (uint64_t u : used_) held += u;
  if (limit && held > limit)
    fail(LWO_ERR_OVER_BUDGET, "a budget of %llu bytes is below the %llu bytes already held",
         static_cast<unsigned long long>(limit), static_cast<unsigned long long>(held));
  budget_ = limit;
}

void Engine::set_budget(uint64_t bytes, double share, uint64_t headroom) {
  if (!(share >= 0.0 && share <= 1.0))
    fail(LWO_ERR_INVALID_ARGUMENT, "budget_share %g is outside [0, 1]", share);
  uint64_t limit = bytes;
  if (share > 0 || headroom) {
    size_t free_b = 0, total_b = 0;
    {
      DeviceScope scope(*this);
      gpu_->mem_get_info(&free_b, &total_b);
    }
    uint64_t held = 0;
    memory_use(nullptr, &held);
    uint64_t avail = static_cast<uint64_t>(free_b) + held;  // what lwo could hold
    if (share > 0) {
      uint64_t s = static_cast<uint64_t>(share * static_cast<double>(avail));
      limit = limit ? std::min(limit, s) : s;
    }
    if (headroom) {
      if (headroom >= avail)
        fail(LWO_ERR_OVER_BUDGET, "a headroom of %llu bytes leaves nothing of the %llu bytes "
             "free on device %d (%llu of them held by lwo)", static_cast<unsigned long long>(headroom),
             static_cast<unsigned long long>(avail), device_, static_cast<unsigned long long>(held));
      limit = limit ? std::min(limit, avail - headroom) : avail - headroom;
    }
    if (limit == 0)
      fail(LWO_ERR_OVER_BUDGET, "budget_share %g of the %llu bytes free on device %d is 0 bytes",
           share, static_cast<unsigned long long>(avail), device_);
  }
  set_budget(limit);
}

uint64_t Engine::budget() const {
  std::lock_guard<std::mutex> lock(budget_mu_);
  return budget_;
}

uint64_t Engine::charge(MemUse use, uint64_t bytes, uint64_t n_allocs, const char* what) {
  // n_allocs allocations of `bytes` each.
  uint64_t each = device_footprint(bytes);
  if (n_allocs && each > UINT64_MAX / n_allocs)
    fail(LWO_ERR_OVER_BUDGET, "%s: %llu x %llu bytes overflow", what,
         static_cast<unsigned long long>(n_allocs), static_cast<unsigned long long>(bytes));
  uint64_t need = each * n_allocs;
  std::lock_guard<std::mutex> lock(budget_mu_);
  uint64_t held = 0;
  for (uint64_t u : used_) held += u;
  if (budget_ && need > budget_ - std::min(held, budget_)) {
    std::string by;
    for (uint32_t i = 0; i < kMemUses; ++i)
      if (used_[i])
        by += strf("%s%s %llu", by.empty() ? "" : ", ", mem_use_name(static_cast<MemUse>(i)),
                   static_cast<unsigned long long>(used_[i]));
    fail(LWO_ERR_OVER_BUDGET,
         "%s need %llu bytes of device memory but the engine's budget of %llu bytes has %llu "
         "left (%llu held%s%s%s)",
         what, static_cast<unsigned long long>(need), static_cast<unsigned long long>(budget_),
         static_cast<unsigned long long>(budget_ - std::min(held, budget_)),
         static_cast<unsigned long long>(held), by.empty() ? "" : ": ", by.c_str(), "");
  }
  used_[static_cast<uint32_t>(use)] += need;
  return need;
}

void Engine::uncharge(MemUse use, uint64_t charged) noexcept {
  std::lock_guard<std::mutex> lock(budget_mu_);
  uint64_t& u = used_[static_cast<uint32_t>(use)];
  u -= std::min(u, charged);
}

void Engine::memory_use(uint64_t* by_use, uint64_t* total) const {
  std::lock_guard<std::mutex> lock(budget_mu_);
  uint64_t t = 0;
  for (uint32_t i = 0; i < kMemUses; ++i) {
    if (by_use) by_use[i] = used_[i];
    t += used_[i];
  }
  if (total) *total = t;
}

// ---- host memory budget ----

void Engine::set_host_limit(uint64_t limit) {
  std::lock_guard<std::mutex> lock(budget_mu_);
  host_limit_ = limit;
}

uint64_t Engine::host_limit() const {
  std::lock_guard<std::mutex> lock(budget_mu_);
  return host_limit_;
}

uint64_t Engine::host_charged() const {
  std::lock_guard<std::mutex> lock(budget_mu_);
  return host_used_;
}

bool Engine::try_charge_host(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(budget_mu_);
  if (host_limit_ && bytes > host_limit_ - std::min(host_used_, host_limit_)) return false;
  host_used_ += bytes;
  return true;
}

void Engine::charge_host(uint64_t bytes, const char* what) {
  if (try_charge_host(bytes)) return;
  std::lock_guard<std::mutex> lock(budget_mu_);
  fail(LWO_ERR_OVER_BUDGET,
       "%s: %llu bytes of host memory asked, %llu bytes charged, host limit %llu bytes",
       what, static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(host_used_),
       static_cast<unsigned long long>(host_limit_));
}

void Engine::uncharge_host(uint64_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(budget_mu_);
  host_used_ -= std::min(host_used_, bytes);
}

namespace {
// The first number after `key` in file `path`, or false.
bool read_number(const std::string& path, const char* key, uint64_t* v, int base = 10) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char buf[4096];
  bool ok = false;
  size_t klen = key ? std::strlen(key) : 0;
  while (std::fgets(buf, sizeof buf, f)) {
    if (key && std::strncmp(buf, key, klen) != 0) continue;
    char* end = nullptr;
    const char* p = buf + klen;
    while (*p == ' ' || *p == '\t') ++p;
    unsigned long long x = std::strtoull(p, &end, base);
    if (end != p) {
      *v = x;
      ok = true;
    }
    break;
  }
  std::fclose(f);
  return ok;
}
uint64_t less_margin(uint64_t x) {
  uint64_t m = std::max<uint64_t>(x / 8, uint64_t(256) << 20);
  return x - std::min(m, x / 2);
}
}  // namespace

uint64_t derive_host_limit(const char* proc_root, const char* cgroup_root) {
  const std::string proc = proc_root, cg = cgroup_root;
  uint64_t limit = 0;
  auto take = [&](uint64_t v) { limit = limit ? std::min(limit, v) : v; };
  uint64_t v = 0;
  // cgroup v2 ("max" reads as no number) and v1 (a huge number: no limit).
  if (read_number(cg + "/memory.max", nullptr, &v)) take(less_margin(v));
  if (read_number(cg + "/memory/memory.limit_in_bytes", nullptr, &v) && v < (uint64_t(1) << 60))
    take(less_margin(v));
  if (read_number(proc + "/meminfo", "MemAvailable:", &v)) take(less_margin(v * 1024));
  // RLIMIT_MEMLOCK is not a term: CUDA's pinning (cudaHostAlloc,
  // cudaHostRegister) is not charged against it, so a default limit of a
  // few MiB would refuse pools the system gives.
  return limit;
}

uint64_t default_host_limit() {
  const char* root = std::getenv("LWO_TEST_HOST_ROOT");
  std::string proc = "/proc", cg = "/sys/fs/cgroup";
  if (root && root[0]) {
    proc = std::string(root) + "/proc";
    cg = std::string(root) + "/sys/fs/cgroup";
  }
  return derive_host_limit(proc.c_str(), cg.c_str());
}

void Engine::check_left_capture(const char* what) const {
  const void* r = left_capture_.load();
  if (!r) return;
  Engine& self = const_cast<Engine&>(*this);  // a query: nothing of the engine changes
  DeviceScope scope(self);
  Backend& gpu = self.gpu();
  if (gpu.capture_status(h2d_) == Backend::CaptureStatus::None &&
      gpu.capture_status(d2h_) == Backend::CaptureStatus::None) {
    left_capture_.compare_exchange_strong(r, nullptr);  // the caller ended it
    return;
  }
  fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine left a capture the caller began "
       "(lwo_ring_capture_leave) that has not ended: the engine's transfer and gradient streams "
       "are part of it until the caller ends it (cudaStreamEndCapture), and this call's work "
       "would be captured into the caller's graph", what, r);
}

void Engine::check_not_capturing(const char* what) const {
  check_left_capture(what);
  if (const void* r = capture_owner_.load()) {
    if (capture_joined_.load())
      fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine has joined a CUDA graph capture "
           "(lwo_ring_capture_join); leave it first (lwo_ring_capture_leave)", what, r);
    fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine is capturing a CUDA graph "
         "(lwo_ring_capture_begin); end the capture first (lwo_ring_capture_end)", what, r);
  }
}

void Engine::join_capture(CapturePart* part) {
  std::lock_guard<std::mutex> lock(parts_mu_);
  if (std::find(capture_parts_.begin(), capture_parts_.end(), part) == capture_parts_.end())
    capture_parts_.push_back(part);
}

std::vector<CapturePart*> Engine::take_capture_parts() {
  std::lock_guard<std::mutex> lock(parts_mu_);
  std::vector<CapturePart*> parts;
  parts.swap(capture_parts_);
  return parts;
}

void Engine::synchronize() {
  check_not_capturing("synchronizing the engine");
  DeviceScope scope(*this);
  gpu_->stream_sync(h2d_);
  gpu_->stream_sync(d2h_);
  gpu_->stream_sync(collective_stream_);
}

}  // namespace lwo

namespace lwo {
namespace {

// What one rank is about to do, as exchanged by the collective check.
struct Tag {
  uint64_t seq;
  uint64_t bytes;
  uint32_t magic;
  uint32_t kind;  // 1 stage, 2 gradient end
  uint32_t layer;
  uint32_t hit;
};
static_assert(sizeof(Tag) == 32, "tags are exchanged as 32 bytes");
constexpr uint32_t kTagMagic = 0x6c776f63;  // "lwoc"

std::string describe(const Tag& t) {
  // The step is named by the call that makes it on every rank.
  const char* what = t.kind == Engine::Step::Stage      ? "lwo_ring_stage"
                     : t.kind == Engine::Step::GradsEnd ? "lwo_grads_end"
                                                        : "?";
  std::string s = strf("step %llu: %s of layer %u (%llu bytes", static_cast<unsigned long long>(t.seq),
                       what, t.layer, static_cast<unsigned long long>(t.bytes));
  if (t.hit == 2) return s + ", which fails on that rank)";
  if (t.kind == 1) s += t.hit ? ", a hit" : ", a copy";
  return s + ")";
}

}  // namespace

void Engine::announce_failure(void* comm, Step::Kind kind, uint32_t layer) noexcept {
  Step failing{kind, layer};
  failing.failing = true;
  try {
    exchange(comm, failing);
  } catch (...) {
    // The other ranks learn of this rank's error; this rank reports its own.
  }
}

void Engine::exchange(void* comm, const Step& step) {
  std::lock_guard<std::mutex> lock(check_mu_);
  DeviceScope scope(*this);
  auto it = checks_.find(comm);
  if (it == checks_.end()) {
    CommCheck c;
    gpu_->comm_info(comm, &c.n_ranks, &c.rank);
    size_t bytes = sizeof(Tag) * static_cast<size_t>(c.n_ranks);
    c.dev = static_cast<uint8_t*>(gpu_->device_alloc(bytes));
    try {
      c.host = static_cast<uint8_t*>(gpu_->host_alloc_pinned(bytes));
    } catch (...) {
      gpu_->device_free(c.dev);
      throw;
    }
    it = checks_.emplace(comm, c).first;
  }
  CommCheck& c = it->second;
  Tag mine{};
  mine.seq = c.seq;
  mine.bytes = step.bytes;
  mine.magic = kTagMagic;
  mine.kind = step.kind;
  mine.layer = step.layer;
  mine.hit = step.failing ? 2 : step.hit ? 1 : 0;
  size_t at = sizeof(Tag) * static_cast<size_t>(c.rank);
  std::memcpy(c.host + at, &mine, sizeof(Tag));
  gpu_->copy_h2d(c.dev + at, c.host + at, sizeof(Tag), collective_stream_);
  gpu_->all_gather(c.dev + at, c.dev, sizeof(Tag), comm, collective_stream_);
  gpu_->copy_d2h(c.host, c.dev, sizeof(Tag) * static_cast<size_t>(c.n_ranks), collective_stream_);
  gpu_->stream_sync(collective_stream_);
  ++c.seq;
  std::string diff;
  for (int r = 0; r < c.n_ranks; ++r) {
    Tag t;
    std::memcpy(&t, c.host + sizeof(Tag) * static_cast<size_t>(r), sizeof(Tag));
    if (std::memcmp(&t, &mine, sizeof(Tag)) != 0)
      diff += strf("; rank %d: %s", r, t.magic == kTagMagic ? describe(t).c_str() : "garbage");
  }
  if (!diff.empty())
    fail(LWO_ERR_COLLECTIVE_MISMATCH,
         "layer %u: the ranks of communicator %p are not making the same collective call "
         "(rank %d: %s%s); every rank must stage the same layers and end the same gradients in "
         "the same order",
         step.layer, comm, c.rank, describe(mine).c_str(), diff.c_str());
}

}  // namespace lwo
