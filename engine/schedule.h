// A schedule: an ordered list of layer ids driven through a ring. next()
// releases the previous layer, keeps up to depth layers staged ahead and
// acquires the next one: a whole pass is one loop of next() calls.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "ring.h"

namespace lwo {

class Schedule {
 public:
  Schedule(Ring& ring, const uint32_t* layers, uint32_t n);
  ~Schedule();  // releases what it holds on the last stream it was given

  // LWO_OK with *view filled, or LWO_END after the last layer.
  lwo_status_t next(StreamH stream, lwo_layer_view* view);
  void reset(StreamH stream);
  uint32_t position();
  Ring& ring() { return ring_; }

 private:
  void release_all(StreamH stream);
  lwo_status_t next_locked(StreamH stream, lwo_layer_view* view);

  Ring& ring_;
  std::vector<uint32_t> order_;
  std::mutex mu_;
  size_t pos_ = 0;  // index of the next layer to return
  bool holding_ = false;
  lwo_ticket held_{0};
  // Tickets staged ahead, by position, in order; the front is pos_.
  std::deque<std::pair<size_t, lwo_ticket>> ahead_;
  StreamH last_stream_ = nullptr;
};

}  // namespace lwo
