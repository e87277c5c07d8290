// The engine: one CUDA device, its transfer and gradient streams.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "backend.h"
#include "src/common/error.h"

namespace lwo {

class Compute;

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
  template <class Plan>
  void collective_step(void* comm, Step::Kind kind, uint32_t layer, Plan&& plan) {
    Step step{kind, layer};
    if (!comm || !check_collectives_) {
      plan(step);
      return;
    }
    try {
      plan(step);
    } catch (const Error&) {
      announce_failure(comm, kind, layer);
      throw;
    }
    exchange(comm, step);
  }
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

  // Throws LWO_ERR_BUSY while pools of the engine exist.
  void check_destroyable() const;
  std::atomic<int> n_pools{0};  // live pools of the engine (they count themselves)

 private:
  std::unique_ptr<Backend> gpu_;
  int device_;
  StreamH h2d_ = nullptr;
  StreamH d2h_ = nullptr;
  StreamH comm_ = nullptr;
  bool check_collectives_ = false;
  bool tune_gemms_ = true;
  void exchange(void* comm, const Step& step);
  // Tells the other ranks that this rank fails the step on its own (their
  // mismatch error names it); this rank's own error is the caller's to throw.
  void announce_failure(void* comm, Step::Kind kind, uint32_t layer) noexcept;
  std::mutex compute_mu_;
  std::unique_ptr<Compute> compute_;
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
