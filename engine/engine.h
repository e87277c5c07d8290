// The engine: one CUDA device, its transfer and gradient streams.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "backend.h"

namespace lwo {

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
  StreamH comm() const { return comm_; }  // collectives of sharded pools

  // One collective step of a sharded pool, as the debug check compares it.
  struct Step {
    const char* call;   // "lwo_ring_stage" or "lwo_grads_end"
    uint32_t layer;
    uint64_t bytes;     // record (stage) or gradient (end) bytes
    bool hit;           // a stage that moves nothing
    bool failing;       // this rank fails the call on its own (bad input)
  };
  // With collective checking on (LWO_ENGINE_CHECK_COLLECTIVES or the
  // environment's LWO_CHECK_COLLECTIVES=1), exchanges `step` with every rank
  // of `comm` and throws LWO_ERR_COLLECTIVE_MISMATCH on every rank if any
  // rank is about to do something else. Blocks until all ranks arrive. A
  // no-op otherwise.
  void check_collective(void* comm, const Step& step);
  bool checks_collectives() const { return check_collectives_; }
  void set_check_collectives(bool on) { check_collectives_ = on; }

  // Throws the first error that device work of this engine reported.
  void check();
  void synchronize();

  std::atomic<int> n_pools{0};

 private:
  std::unique_ptr<Backend> gpu_;
  int device_;
  StreamH h2d_ = nullptr;
  StreamH d2h_ = nullptr;
  StreamH comm_ = nullptr;
  bool check_collectives_ = false;
  struct CommCheck {
    int n_ranks = 1, rank = 0;
    uint64_t seq = 0;       // collective steps checked so far on this communicator
    uint8_t* dev = nullptr;   // n_ranks tags
    uint8_t* host = nullptr;  // pinned, n_ranks tags
  };
  std::mutex check_mu_;
  std::map<void*, CommCheck> checks_;
};

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
