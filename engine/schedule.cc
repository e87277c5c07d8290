#include "schedule.h"

#include "src/common/error.h"

namespace lwo {

Schedule::Schedule(Ring& ring, const uint32_t* layers, uint32_t n) : ring_(ring) {
  if (n == 0) fail(LWO_ERR_INVALID_ARGUMENT, "the schedule has 0 layers");
  if (!layers) fail(LWO_ERR_INVALID_ARGUMENT, "layers is NULL");
  uint32_t nl = ring.pool().n_layers();
  for (uint32_t i = 0; i < n; ++i)
    if (layers[i] >= nl)
      fail(LWO_ERR_OUT_OF_RANGE, "entry %u is layer %u, out of range (pool has %u layers)", i,
           layers[i], nl);
  order_.assign(layers, layers + n);
  ring_.n_schedules.fetch_add(1);
}

Schedule::~Schedule() {
  try {
    release_all(last_stream_);
  } catch (...) {
  }
  ring_.n_schedules.fetch_sub(1);
}

void Schedule::release_all(StreamH stream) {
  if (holding_) {
    holding_ = false;
    ring_.release(held_, stream);
  }
  while (!ahead_.empty()) {
    lwo_ticket t = ahead_.front().second;
    ahead_.pop_front();
    ring_.release(t, stream);
  }
}

lwo_status_t Schedule::next(StreamH stream, lwo_layer_view* view) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    return next_locked(stream, view);
  } catch (const Error& e) {
    fail(e.status(), "position %zu of %zu (layer %u): %s", pos_, order_.size(),
         pos_ < order_.size() ? order_[pos_] : 0u, e.what());
  }
}

lwo_status_t Schedule::next_locked(StreamH stream, lwo_layer_view* view) {
  last_stream_ = stream;
  if (holding_) {
    holding_ = false;
    ring_.release(held_, stream);
  }
  if (pos_ >= order_.size()) return LWO_END;
  // Stage ahead: positions pos_.. while fewer than depth tickets are out.
  size_t p = ahead_.empty() ? pos_ : ahead_.back().first + 1;
  while (ahead_.size() < ring_.depth() && p < order_.size()) {
    try {
      ahead_.emplace_back(p, ring_.stage(order_[p]));
    } catch (const Error& e) {
      // A later position that cannot be staged yet (the ring is full of the
      // caller's own tickets, or the same layer comes twice in the window)
      // waits for a later call. The current position must succeed.
      if (p == pos_ ||
          (e.status() != LWO_ERR_RING_FULL && e.status() != LWO_ERR_LAYER_BUSY))
        throw;
      break;
    }
    ++p;
  }
  lwo_ticket t = ahead_.front().second;
  ring_.acquire(t, stream, view);
  ahead_.pop_front();
  held_ = t;
  holding_ = true;
  ++pos_;
  return LWO_OK;
}

void Schedule::reset(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  last_stream_ = stream;
  release_all(stream);
  pos_ = 0;
}

uint32_t Schedule::position() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint32_t>(pos_);
}

}  // namespace lwo
