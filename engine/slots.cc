#include "slots.h"

namespace lwo {

SlotSet::SlotSet(Backend& gpu, uint32_t n, uint64_t bytes)
    : SlotSet(gpu, std::vector<uint64_t>(n, bytes)) {
  bytes_ = bytes;
}

SlotSet::SlotSet(Backend& gpu, const std::vector<uint64_t>& sizes) : gpu_(gpu), bytes_(0) {
  slots_.resize(sizes.size());
  for (uint64_t b : sizes) bytes_ = b > bytes_ ? b : bytes_;
  try {
    for (size_t i = 0; i < slots_.size(); ++i) {
      DeviceSlot& s = slots_[i];
      s.dev = static_cast<uint8_t*>(gpu.device_alloc(sizes[i]));
      s.ready = gpu.event_create(false);
      s.free = gpu.event_create(false);
      s.aux = gpu.event_create(false);
    }
  } catch (...) {
    release();
    throw;
  }
}

SlotSet::~SlotSet() { release(); }

void SlotSet::release() noexcept {
  for (DeviceSlot& s : slots_) {
    gpu_.device_free(s.dev);
    gpu_.event_destroy(s.ready);
    gpu_.event_destroy(s.free);
    gpu_.event_destroy(s.aux);
    s = DeviceSlot{};
  }
}

}  // namespace lwo
