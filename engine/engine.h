// The engine: one CUDA device, its transfer and gradient streams.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "src/common/error.h"
#include "src/common/thread_pool.h"

namespace lwo {

// The byte checking mode fills memory with (lwo.h, LWO_CHECKING_BYTE).
constexpr uint8_t kCheckingByte = LWO_CHECKING_BYTE;

class Compute;

// What a ring's CUDA graph holds besides the ring's own pass: a gradient
// set's ends (engine/grads.h). A participant joins the engine's capture at
// its first call in it (Engine::join_capture); the capturing ring then tells
// it how the capture ends and hands it to the graph, which tells it about
// each launch and its own end.
class CapturePart {
 public:
  virtual ~CapturePart() = default;
  // Before the capture ends: what would make it end wrong ("" if nothing),
  // in words (a gradient layer begun and not ended).
  virtual std::string live() = 0;
  // Before the capture ends, on its stream: joins every stream the
  // participant brought into the capture back into `stream`.
  virtual void join_back(StreamH stream) = 0;
  // The capture ended, kept by a graph or discarded; later work of the
  // participant is ordered after `stream`'s. A null `stream`: the ring left
  // a capture the caller began, which goes on (lwo_ring_capture_leave), or
  // one invalidated: nothing is ordered now; a kept graph is the caller's,
  // given back by lwo_ring_capture_release (released).
  virtual void ended(bool kept, StreamH stream) noexcept = 0;
  // Each launch: check throws, changing nothing, where a replay now would be
  // wrong; arm does the host side of one replay (before the launch, so the
  // replay's host functions find it), disarm undoes it if the launch fails,
  // launched gives the event recorded after it (for the caller's graph of a
  // joined capture, by a node of it at each replay).
  virtual void check_launch() = 0;
  virtual void arm() = 0;
  virtual void disarm() noexcept = 0;
  virtual void launched(EventH done) noexcept = 0;
  // The graph is destroyed; `last` is its last launch's event, done (null:
  // none).
  virtual void released(EventH last) noexcept = 0;
};

// ---- The device memory budget ----
// What lwo holds on the device, by use. Every device allocation of the
// library is charged before it is made (Engine::charge) and uncharged when
// freed, so the sum never passes the engine's limit.
enum class MemUse : uint32_t { Slots = 0, Resident = 1, Grads = 2, Workspace = 3, Other = 4 };
constexpr uint32_t kMemUses = 5;
const char* mem_use_name(MemUse u);
// The bytes the budget charges for one allocation of `bytes`: cudaMalloc
// hands out 2 MiB pages for large requests and 512-byte units for small ones.
inline uint64_t device_footprint(uint64_t bytes) {
  const uint64_t g = bytes >= (uint64_t(1) << 20) ? (uint64_t(2) << 20) : 512;
  return (bytes + g - 1) / g * g;
}

class Engine {
 public:
  // Takes the backend; creates the engine's streams on `device`.
  Engine(std::unique_ptr<Backend> backend, int device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Backend& gpu() { return *gpu_; }
  int device() const { return device_; }
  StreamH h2d() const { return h2d_; }
  StreamH d2h() const { return d2h_; }
  StreamH collective_stream() const { return collective_stream_; }  // collectives of sharded pools
  // The host threads every piece of host work of the engine runs on (pool
  // fills, staged packing, gradient addition, quantization, the optimizer):
  // the process's pool, shared by every engine (ThreadPool::process).
  ThreadPool& threads() const { return threads_; }

  // One collective step of a sharded pool, as the debug check compares it.
  struct Step {
    enum Kind : uint32_t { Stage = 1, GradsEnd = 2 } kind;
    uint32_t layer;
    uint64_t bytes = 0;    // record (stage) or gradient (end) bytes
    bool hit = false;      // a stage that moves nothing
    bool failing = false;  // this rank fails the call on its own (bad input)
  };
  // One collective step of communicator `comm` (null: a rank-local pool).
  // `plan` validates this rank's call and fills in the step's bytes and hit;
  // it throws lwo::Error on bad input. With collective checking on
  // (LWO_ENGINE_CHECK_COLLECTIVES or the environment's
  // LWO_CHECK_COLLECTIVES=1) the step is then exchanged with every rank and
  // LWO_ERR_COLLECTIVE_MISMATCH thrown on every rank if any rank is about to
  // do something else; a rank whose plan throws first tells the others it
  // fails (so they fail instead of hanging) and rethrows its own error.
  // Blocks until all ranks arrive. Otherwise it only runs `plan`.
  // (A template: it runs on every stage, and the check is off but in debug.)
  // A step over several communicators (nulls skipped; a gradient end of a
  // set with a replica communicator) is exchanged on each in turn; a rank
  // that fails on one announces the failure on the rest, so that no rank of
  // those waits for it.
  template <class Plan>
  void collective_step(std::initializer_list<void*> comms, Step::Kind kind, uint32_t layer,
                       Plan&& plan) {
    Step step{kind, layer};
    bool any = false;
    for (void* c : comms) any = any || c;
    if (!any || !check_collectives_) {
      plan(step);
      return;
    }
    auto announce_from = [&](void* const* from) noexcept {
      for (void* const* c = from; c != comms.end(); ++c)
        if (*c) announce_failure(*c, kind, layer);
    };
    try {
      plan(step);
    } catch (const Error&) {
      announce_from(comms.begin());
      throw;
    }
    for (void* const* c = comms.begin(); c != comms.end(); ++c) {
      if (!*c) continue;
      try {
        exchange(*c, step);
      } catch (const Error&) {
        announce_from(c + 1);
        throw;
      }
    }
  }
  template <class Plan>
  void collective_step(void* comm, Step::Kind kind, uint32_t layer, Plan&& plan) {
    collective_step({comm}, kind, layer, std::forward<Plan>(plan));
  }
  // Checking mode (LWO_ENGINE_CHECKING or the environment's LWO_CHECKING=1):
  // released ring slots, ended gradient slots and host gradients not yet
  // landed hold kCheckingByte. Rings and gradient sets take it at creation.
  bool checking() const { return checking_; }
  void set_checking(bool on) { checking_ = on; }
  // The ring that captures a CUDA graph on this engine (lwo_ring_capture_begin
  // until lwo_ring_capture_end), or null: while one does, the transfer stream
  // is part of its capture. check_not_capturing throws LWO_ERR_CAPTURING,
  // naming `what`, while a ring captures.
  const void* capture_owner() const { return capture_owner_.load(); }
  // The capturing ring's pool (null: none), set with the owner.
  const void* capture_pool() const { return capture_pool_.load(); }
  // `joined`: the capture is one the caller began, which the ring joined
  // (lwo_ring_capture_join): the caller's cudaGraphLaunch replays it.
  void set_capture_owner(const void* ring, const void* pool = nullptr, bool joined = false) {
    capture_pool_.store(ring ? pool : nullptr);
    capture_joined_.store(ring && joined);
    capture_owner_.store(ring);
  }
  bool capture_joined() const { return capture_joined_.load(); }
  // A ring that left a capture the caller began (lwo_ring_capture_leave),
  // which the caller has not ended yet: until it does, the transfer stream
  // (and the gradient stream, where gradient sets took part) are still
  // streams of that capture, and eager work of the engine would be captured
  // into the caller's graph. check_left_capture throws LWO_ERR_CAPTURING,
  // naming `what`, while they capture, and forgets the ring once they do not.
  void set_left_capture(const void* ring) { left_capture_.store(ring); }
  void forget_left_capture(const void* ring) {
    left_capture_.compare_exchange_strong(ring, nullptr);
  }
  void check_left_capture(const char* what) const;
  // Throws LWO_ERR_CAPTURING while a ring captures, or while a capture that
  // a ring left goes on (check_left_capture).
  void check_not_capturing(const char* what) const;
  // The capture gate. A C ABI call that checks that no capture is under way
  // and then enqueues work on the engine's streams, or waits on them, holds
  // it shared from before the check to the end of its work
  // (bindings/c/abi.h, CaptureGate); lwo_ring_capture_begin and _join hold
  // it alone from before their own check until the ring owns the capture.
  // So an eager call either is refused, or has enqueued all its work before
  // the capture's streams joined it; and two captures never begin together.
  std::shared_mutex& capture_gate() const { return capture_gate_; }
  // A participant of the capture under way (once); the capturing ring takes
  // them all when the capture ends.
  void join_capture(CapturePart* part);
  std::vector<CapturePart*> take_capture_parts();
  bool checks_collectives() const { return check_collectives_; }
  void set_check_collectives(bool on) { check_collectives_ = on; }
  // Time GEMM candidates on first use (LWO_ENGINE_HEURISTIC_GEMM: off). Set
  // before the first compute call.
  void set_tune_gemms(bool on) { tune_gemms_ = on; }

  // Throws the first error that device work of this engine reported.
  void check();
  void synchronize();

  // Layer compute (cuBLASLt, cuDNN), made on first use and destroyed first.
  Compute& compute();

  // ---- device memory budget ----
  // `limit` bytes in all (0: no limit). Throws LWO_ERR_OVER_BUDGET when what
  // is already held exceeds it.
  void set_budget(uint64_t limit);
  // The limit from the lwo_engine_config / lwo_engine_set_budget fields:
  // `bytes` (0: none), a `share` in (0, 1] of the device memory free to lwo
  // (free now plus what lwo holds), and a `headroom` that keeps that many
  // bytes of it free for others; the smallest that applies. All 0: no limit.
  // Throws LWO_ERR_INVALID_ARGUMENT (share), LWO_ERR_OVER_BUDGET.
  void set_budget(uint64_t bytes, double share, uint64_t headroom);
  uint64_t budget() const;
  // Charges device_footprint(b) for each allocation of `sizes` under `use`,
  // or throws LWO_ERR_OVER_BUDGET naming `what`, the bytes needed and the
  // bytes left, charging nothing. Returns the bytes charged.
  uint64_t charge(MemUse use, uint64_t bytes, uint64_t n_allocs, const char* what);
  void uncharge(MemUse use, uint64_t charged) noexcept;
  // Bytes held now, by use (kMemUses entries), and in all.
  void memory_use(uint64_t* by_use, uint64_t* total) const;

  // ---- host memory budget ----
  // Every host buffer lwo pins, registers or allocates for its objects (pool
  // arenas and registered regions, staging buffers, host gradients, the
  // host optimizer's masters and state) is charged here before it is made
  // and uncharged when freed. `limit` 0: no limit.
  void set_host_limit(uint64_t limit);
  uint64_t host_limit() const;
  uint64_t host_charged() const;
  // Charges `bytes` or throws LWO_ERR_OVER_BUDGET naming `what`, the bytes
  // asked, the bytes charged and the limit, charging nothing.
  void charge_host(uint64_t bytes, const char* what);
  // As charge_host, but answers false instead of throwing.
  bool try_charge_host(uint64_t bytes);
  void uncharge_host(uint64_t bytes) noexcept;

  // Throws LWO_ERR_BUSY while pools of the engine exist.
  void check_destroyable() const;
  std::atomic<int> n_pools{0};  // live pools of the engine (they count themselves)

 private:
  std::unique_ptr<Backend> gpu_;
  int device_;
  ThreadPool& threads_;
  StreamH h2d_ = nullptr;
  StreamH d2h_ = nullptr;
  StreamH collective_stream_ = nullptr;
  bool check_collectives_ = false;
  bool checking_ = false;
  std::atomic<const void*> capture_owner_{nullptr};
  std::atomic<const void*> capture_pool_{nullptr};
  std::atomic<bool> capture_joined_{false};
  mutable std::atomic<const void*> left_capture_{nullptr};
  mutable std::shared_mutex capture_gate_;
  std::mutex parts_mu_;
  std::vector<CapturePart*> capture_parts_;
  bool tune_gemms_ = true;
  void exchange(void* comm, const Step& step);
  // Tells the other ranks that this rank fails the step on its own (their
  // mismatch error names it); this rank's own error is the caller's to throw.
  void announce_failure(void* comm, Step::Kind kind, uint32_t layer) noexcept;
  std::mutex compute_mu_;
  std::unique_ptr<Compute> compute_;
  mutable std::mutex budget_mu_;
  uint64_t budget_ = 0;             // 0: no limit
  uint64_t used_[kMemUses] = {};
  uint64_t host_limit_ = 0;         // 0: no limit
  uint64_t host_used_ = 0;
  struct CommCheck {
    int n_ranks = 1, rank = 0;
    uint64_t seq = 0;       // collective steps checked so far on this communicator
    uint8_t* dev = nullptr;   // n_ranks tags
    uint8_t* host = nullptr;  // pinned, n_ranks tags
  };
  std::mutex check_mu_;
  std::map<void*, CommCheck> checks_;
};

// One charge of the budget, uncharged when destroyed (movable).
class Charge {
 public:
  Charge() = default;
  Charge(Engine& e, MemUse use, uint64_t bytes, uint64_t n_allocs, const char* what)
      : e_(&e), use_(use), bytes_(e.charge(use, bytes, n_allocs, what)) {}
  ~Charge() { reset(); }
  Charge(Charge&& o) noexcept { *this = static_cast<Charge&&>(o); }
  Charge& operator=(Charge&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = o.e_;
      use_ = o.use_;
      bytes_ = o.bytes_;
      o.e_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;
  void reset() noexcept {
    if (e_ && bytes_) e_->uncharge(use_, bytes_);
    e_ = nullptr;
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  Engine* e_ = nullptr;
  MemUse use_ = MemUse::Other;
  uint64_t bytes_ = 0;
};

// One charge of the host budget, uncharged when destroyed (movable).
class HostCharge {
 public:
  HostCharge() = default;
  HostCharge(Engine& e, uint64_t bytes, const char* what) : e_(&e), bytes_(bytes) {
    e.charge_host(bytes, what);
  }
  ~HostCharge() { reset(); }
  HostCharge(HostCharge&& o) noexcept { *this = static_cast<HostCharge&&>(o); }
  HostCharge& operator=(HostCharge&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = o.e_;
      bytes_ = o.bytes_;
      o.e_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  HostCharge(const HostCharge&) = delete;
  HostCharge& operator=(const HostCharge&) = delete;
  // Takes over a charge made with try_charge_host.
  static HostCharge adopt(Engine& e, uint64_t bytes) {
    HostCharge c;
    c.e_ = &e;
    c.bytes_ = bytes;
    return c;
  }
  void reset() noexcept {
    if (e_ && bytes_) e_->uncharge_host(bytes_);
    e_ = nullptr;
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  Engine* e_ = nullptr;
  uint64_t bytes_ = 0;
};

// The host limit an engine takes by default: the smallest of the cgroup's
// memory limit (v2 memory.max, v1 memory.limit_in_bytes), /proc/meminfo's
// MemAvailable, each less a margin (an eighth of it, at least 256 MiB, at
// most half). 0 when nothing is known. RLIMIT_MEMLOCK is not a term: CUDA's
// pinned and registered memory is not charged against it.
// `proc_root` and `cgroup_root` are "/proc" and "/sys/fs/cgroup" but in
// tests.
uint64_t derive_host_limit(const char* proc_root, const char* cgroup_root);
// derive_host_limit for this process: the real paths, or those under the
// test-only environment variable LWO_TEST_HOST_ROOT (ROOT/proc,
// ROOT/sys/fs/cgroup).
uint64_t default_host_limit();

// Makes the engine's device current for the scope and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(Engine& e) : gpu_(e.gpu()) {
    prev_ = gpu_.get_device();
    if (prev_ != e.device()) {
      gpu_.set_device(e.device());
      changed_ = true;
    }
  }
  ~DeviceScope() {
    if (changed_) {
      try {
        gpu_.set_device(prev_);
      } catch (...) {
      }
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  Backend& gpu_;
  int prev_ = 0;
  bool changed_ = false;
};

}  // namespace lwo
