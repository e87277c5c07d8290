#include "engine.h"

#include "error.h"

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
}

Engine::~Engine() {
  try {
    DeviceScope scope(*this);
    gpu_->stream_sync(h2d_);
    gpu_->stream_sync(d2h_);
    gpu_->stream_sync(comm_);
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

void Engine::synchronize() {
  DeviceScope scope(*this);
  gpu_->stream_sync(h2d_);
  gpu_->stream_sync(d2h_);
  gpu_->stream_sync(comm_);
}

}  // namespace lwo
