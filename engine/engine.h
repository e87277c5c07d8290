// The engine: one CUDA device, its transfer and gradient streams.
#pragma once

#include <atomic>
#include <memory>

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
