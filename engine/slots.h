// Device slots: one type behind the weight ring and the gradient staging.
// Each slot is device memory of one size with a ready event (its contents are
// complete), a free event (every reader is done) and a spare event for the
// source that fills it. The set hands out the free slot freed longest ago.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace lwo {

struct DeviceSlot {
  uint8_t* dev = nullptr;
  EventH ready = nullptr;
  EventH free = nullptr;
  EventH aux = nullptr;     // the filler's own ordering (shard landed, sum reduced)
  bool ever_freed = false;  // `free` has been recorded at least once
  uint64_t freed_at = 0;    // clock of the last free; 0 = never (taken first)
};

class SlotSet {
 public:
  // `n` slots of `bytes` each; throws (LWO_ERR_OUT_OF_MEMORY, LWO_ERR_CUDA)
  // leaving nothing allocated.
  SlotSet(Backend& gpu, uint32_t n, uint64_t bytes);
  // One slot per entry of `sizes`, each of its own size (resident layers);
  // bytes() is the largest.
  SlotSet(Backend& gpu, const std::vector<uint64_t>& sizes);
  // Frees memory and events; the owner waits for the GPU to be done first.
  ~SlotSet();
  SlotSet(const SlotSet&) = delete;
  SlotSet& operator=(const SlotSet&) = delete;

  size_t size() const { return slots_.size(); }
  uint64_t bytes() const { return bytes_; }
  DeviceSlot& operator[](size_t i) { return slots_[i]; }
  const DeviceSlot& operator[](size_t i) const { return slots_[i]; }

  // The slot i with usable(i) freed longest ago (never freed first, then the
  // lowest index), or -1 if none is usable.
  template <class F>
  int32_t pick(F usable) const {
    int32_t best = -1;
    for (size_t i = 0; i < slots_.size(); ++i)
      if (usable(i) && (best < 0 || slots_[i].freed_at < slots_[best].freed_at))
        best = static_cast<int32_t>(i);
    return best;
  }
  // Slot i's free event was recorded now (by the caller).
  void freed(size_t i) {
    slots_[i].ever_freed = true;
    slots_[i].freed_at = ++clock_;
  }
  // Slot i holds nothing any more: it is taken as if never freed (its free
  // event still orders the next writer).
  void emptied(size_t i) { slots_[i].freed_at = 0; }

 private:
  void release() noexcept;
  Backend& gpu_;
  std::vector<DeviceSlot> slots_;
  uint64_t bytes_;
  uint64_t clock_ = 0;
};

}  // namespace lwo
