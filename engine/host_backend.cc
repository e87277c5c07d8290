// The host backend (backend.h, make_host_backend): the engine on host memory,
// for tests of the library's users on machines with no GPU.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "backend.h"
#include "comm.h"
#include "src/common/error.h"

namespace lwo {
namespace {

constexpr size_t kAlign = 256;                      // as cudaMalloc's alignment (at least)
constexpr uint64_t kTotalBytes = uint64_t(64) << 30;  // the "device" the budget sees

// A one-rank communicator of the host backend: a heap byte, never read.
void destroy_comm(void* comm) { delete static_cast<char*>(comm); }
void* make_comm() {
  char* c = new char(0);
  try {
    register_comm(c, destroy_comm);
  } catch (...) {
    delete c;
    throw;
  }
  return c;
}

class HostBackend final : public Backend {
 public:
  explicit HostBackend(bool poison) : poison_(poison) {}
  ~HostBackend() override {
    for (auto& kv : allocs_) std::free(reinterpret_cast<void*>(kv.first));
  }

  int get_device() override { return device_; }
  void set_device(int device) override { device_ = device; }

  void* device_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + kAlign);
    if (!p) fail(LWO_ERR_OUT_OF_MEMORY, "host backend: device_alloc of %zu bytes failed", bytes);
    std::memset(p, 0xA5, bytes);  // never zero by chance: unwritten bytes show
    std::lock_guard<std::mutex> lock(mu_);
    allocs_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void device_free(void* ptr) noexcept override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocs_.end()) return;
    const uintptr_t b = it->first, e = it->first + it->second;
    for (auto s = shadows_.lower_bound(b); s != shadows_.end() && s->first < e;)
      s = shadows_.erase(s);
    allocs_.erase(it);
    std::free(ptr);
  }
  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t used = 0;
    for (auto& kv : allocs_) used += kv.second;
    *free_bytes = static_cast<size_t>(kTotalBytes - std::min(used, kTotalBytes));
    *total_bytes = static_cast<size_t>(kTotalBytes);
  }

  void* host_alloc_pinned(size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + kAlign);
    if (!p)
      fail(LWO_ERR_OUT_OF_MEMORY, "host backend: host_alloc_pinned of %zu bytes failed", bytes);
    return p;
  }
  void host_free_pinned(void* ptr) noexcept override { std::free(ptr); }
  bool host_register(void*, size_t, bool) override { return true; }
  void host_unregister(void*) noexcept override {}

  // Streams: tokens. Work runs when enqueued, so each stream is in order and
  // every stream is ordered after all work enqueued before.
  StreamH stream_create() override { return new char(0); }
  void stream_destroy(StreamH stream) noexcept override { delete static_cast<char*>(stream); }
  void stream_sync(StreamH) override {}
  void stream_check(StreamH) override {}

  // Events: the host clock when recorded (the work before it is done then).
  EventH event_create(bool) override { return new double(0.0); }
  void event_destroy(EventH event) noexcept override { delete static_cast<double*>(event); }
  void event_record(EventH event, StreamH) override {
    *static_cast<double*>(event) =
        std::chrono::duration<double, std::milli>(
            std::chrono::steady_clock::now().time_since_epoch())
            .count();
  }
  void stream_wait(StreamH, EventH) override {}
  bool event_done(EventH) override { return true; }
  void event_sync(EventH) override {}
  float event_elapsed_ms(EventH start, EventH end) override {
    return static_cast<float>(*static_cast<double*>(end) - *static_cast<double*>(start));
  }

  // Streams run their work when it is enqueued: the fill is done here.
  void fill_device(void* dst, uint8_t value, size_t bytes, StreamH) override {
    std::memset(dst, value, bytes);
  }
  void copy_h2d(void* dst, const void* src, size_t bytes, StreamH) override {
    unpoison(dst, bytes);
    std::memcpy(dst, src, bytes);
  }
  void copy_d2h(void* dst, const void* src, size_t bytes, StreamH) override {
    std::memcpy(dst, src, bytes);
  }

  // Communicators: one-rank stand-ins (no NCCL), registered like NCCL's
  // (engine/comm.h) so lwo_nccl_comm_destroy destroys them. With one rank,
  // an all-gather moves the rank's part to where it already belongs and a
  // reduction leaves every byte as it is.
  void* comm_create(const void*, int n_ranks, int rank) override {
    if (n_ranks != 1)
      fail(LWO_ERR_UNSUPPORTED,
           "rank %d of %d ranks: the host backend's communicators have one rank", rank, n_ranks);
    return make_comm();
  }
  void* comm_split(void* parent, int, int) override {
    int n = 0, r = 0;
    comm_info(parent, &n, &r);
    return make_comm();
  }
  void comm_info(void* comm, int* n_ranks, int* rank) override {
    if (!registered_with(comm, destroy_comm))
      fail(LWO_ERR_UNSUPPORTED,
           "communicator %p: the host backend has collectives only over the one-rank "
           "communicators it makes (lwo_nccl_comm_create of 1 rank, lwo_nccl_comm_split)",
           comm);
    *n_ranks = 1;
    *rank = 0;
  }
  void all_gather(const void* send, void* recv, size_t bytes, void* comm, StreamH) override {
    int n = 0, r = 0;
    comm_info(comm, &n, &r);
    unpoison(recv, bytes);
    if (send != recv) std::memmove(recv, send, bytes);
  }
  void reduce_owned(void*, const uint64_t*, void* comm, StreamH) override {
    int n = 0, r = 0;
    comm_info(comm, &n, &r);
  }

  void host_func(StreamH, void (*fn)(void*), void* arg, const std::vector<HostSpan>&) override {
    fn(arg);  // the stream's earlier work is done: it ran when enqueued
  }

  // Poison: a released slot's bytes are kept aside and the slot filled with
  // 0xff (NaN in every float dtype), so a read after the release shows; an
  // acquire of the slot again (a hit) puts them back, a fill drops them.
  void slot_released(void* ptr, size_t bytes, StreamH) override {
    if (!poison_ || !bytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    // Released again without an acquire between (a hit never acquired): the
    // kept bytes are still the slot's.
    if (shadows_.count(reinterpret_cast<uintptr_t>(ptr))) return;
    auto* p = static_cast<uint8_t*>(ptr);
    std::vector<uint8_t>& keep = shadows_[reinterpret_cast<uintptr_t>(ptr)];
    keep.assign(p, p + bytes);
    std::memset(p, 0xff, bytes);
  }
  void slot_reclaimed(void* ptr, size_t bytes, StreamH) override { unpoison(ptr, bytes); }
  void slot_handed_out(void* ptr, size_t bytes, StreamH) override {
    if (poison_) std::memset(ptr, 0xff, bytes);
  }
  bool compute_on_host() const override { return true; }

 private:
  // Puts back the kept bytes of every released slot overlapping [ptr, ptr + n).
  void unpoison(void* ptr, size_t n) {
    if (!poison_) return;
    std::lock_guard<std::mutex> lock(mu_);
    const uintptr_t b = reinterpret_cast<uintptr_t>(ptr), e = b + n;
    auto s = shadows_.upper_bound(b);
    if (s != shadows_.begin()) --s;
    while (s != shadows_.end() && s->first < e) {
      if (s->first + s->second.size() <= b) {
        ++s;
        continue;
      }
      std::memcpy(reinterpret_cast<void*>(s->first), s->second.data(), s->second.size());
      s = shadows_.erase(s);
    }
  }

  const bool poison_;
  int device_ = 0;
  std::mutex mu_;
  std::map<uintptr_t, size_t> allocs_;
  std::map<uintptr_t, std::vector<uint8_t>> shadows_;  // released slots: their bytes
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(bool poison) {
  return std::make_unique<HostBackend>(poison);
}

}  // namespace lwo
