#include "slots.h"

namespace lwo {

SlotSet::SlotSet(Backend& gpu, uint32_t n, uint64_t bytes) : gpu_(gpu), bytes_(bytes) {
  slots_.resize(n);
  try {
    for (DeviceSlot& s : slots_) {
      s.dev = static_cast<uint8_t*>(gpu.device_alloc(bytes));
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
