#include "engine.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "src/common/error.h"
#include "src/compute/compute.h"

namespace lwo {

Engine::Engine(std::unique_ptr<Backend> backend, int device)
    : gpu_(std::move(backend)), device_(device) {
  int prev = gpu_->get_device();
  gpu_->set_device(device_);
  try {
    h2d_ = gpu_->stream_create();
    d2h_ = gpu_->stream_create();
    comm_ = gpu_->stream_create();
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
}

Engine::~Engine() {
  compute_.reset();  // its workspaces belong to the callers' streams
  try {
    DeviceScope scope(*this);
    gpu_->stream_sync(h2d_);
    gpu_->stream_sync(d2h_);
    gpu_->stream_sync(comm_);
    for (auto& kv : checks_) {
      gpu_->device_free(kv.second.dev);
      gpu_->host_free_pinned(kv.second.host);
    }
  } catch (...) {
  }
  gpu_->stream_destroy(h2d_);
  gpu_->stream_destroy(d2h_);
  gpu_->stream_destroy(comm_);
}

void Engine::check() {
  DeviceScope scope(*this);
  gpu_->stream_check(h2d_);
  gpu_->stream_check(d2h_);
  gpu_->stream_check(comm_);
}

Compute& Engine::compute() {
  std::lock_guard<std::mutex> lock(compute_mu_);
  if (!compute_) compute_ = std::make_unique<Compute>(device_, tune_gemms_);
  return *compute_;
}

void Engine::check_destroyable() const {
  int n = n_pools.load();
  if (n > 0)
    fail(LWO_ERR_BUSY, "engine on device %d still has %d pool%s", device_, n, n == 1 ? "" : "s");
}

void Engine::synchronize() {
  DeviceScope scope(*this);
  gpu_->stream_sync(h2d_);
  gpu_->stream_sync(d2h_);
  gpu_->stream_sync(comm_);
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
  gpu_->copy_h2d(c.dev + at, c.host + at, sizeof(Tag), comm_);
  gpu_->all_gather(c.dev + at, c.dev, sizeof(Tag), comm, comm_);
  gpu_->copy_d2h(c.host, c.dev, sizeof(Tag) * static_cast<size_t>(c.n_ranks), comm_);
  gpu_->stream_sync(comm_);
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
