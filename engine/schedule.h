// A schedule: an ordered list of layer ids driven through a ring. next()
// releases the previous layer, keeps up to depth layers staged ahead and
// acquires the next one: a whole pass is one loop of next() calls.
//
// CUDA graphs: a schedule of the ring that captures drives the capture like
// an eager pass (its stages, acquires and releases are the ring's, captured);
// reset() or reaching the end lets go of its tickets, as the capture's end
// requires. Tickets the ring ends wholesale (a capture discarded while the
// schedule held some) are dropped at the next call, and the pass goes on from
// its position, staging again. While another ring of the engine captures,
// next() and any call that would release a ticket are LWO_ERR_CAPTURING,
// with nothing changed.
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
  // LWO_ERR_CAPTURING while another ring captures and the schedule holds
  // tickets (its destruction would release them outside the capture).
  void check_destroyable();

 private:
  void release_all(StreamH stream);
  lwo_status_t next_locked(StreamH stream, lwo_layer_view* view);
  // Forgets the tickets of an earlier table epoch of the ring (ended).
  void drop_ended();
  bool holds_tickets() const { return holding_ || !ahead_.empty(); }

  Ring& ring_;
  std::vector<uint32_t> order_;
  std::mutex mu_;
  size_t pos_ = 0;  // index of the next layer to return
  bool holding_ = false;
  lwo_ticket held_{0};
  // Tickets staged ahead, by position, in order; the front is pos_.
  std::deque<std::pair<size_t, lwo_ticket>> ahead_;
  uint64_t epoch_ = 0;  // the ring's table epoch of the tickets held
  StreamH last_stream_ = nullptr;
};

}  // namespace lwo
