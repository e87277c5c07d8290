#include "schedule.h"

#include "src/common/error.h"

namespace lwo {

Schedule::Schedule(Ring& ring, const uint32_t* layers, uint32_t n)
    : ring_(ring), epoch_(ring.table_epoch()) {
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
    drop_ended();
    release_all(last_stream_);
  } catch (...) {
  }
  ring_.n_schedules.fetch_sub(1);
}

void Schedule::drop_ended() {
  const uint64_t e = ring_.table_epoch();
  if (e == epoch_) return;
  epoch_ = e;
  holding_ = false;
  ahead_.clear();
}

void Schedule::check_destroyable() {
  std::lock_guard<std::mutex> lock(mu_);
  drop_ended();
  if (holds_tickets())
    ring_.check_not_captured_elsewhere("destroying a schedule that holds tickets of its ring");
}

// Each ticket is forgotten only once its release succeeded: a refused
// release leaves it held, for a later call.
void Schedule::release_all(StreamH stream) {
  if (holding_) {
    ring_.release(held_, stream);
    holding_ = false;
  }
  while (!ahead_.empty()) {
    ring_.release(ahead_.front().second, stream);
    ahead_.pop_front();
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
  drop_ended();
  // Before any release: the call changes nothing while another ring captures.
  if (holds_tickets() || pos_ < order_.size())
    ring_.check_not_captured_elsewhere("driving a schedule of another ring");
  last_stream_ = stream;
  if (holding_) {
    ring_.release(held_, stream);
    holding_ = false;
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
  drop_ended();
  if (holds_tickets()) ring_.check_not_captured_elsewhere("resetting a schedule of another ring");
  last_stream_ = stream;
  release_all(stream);
  pos_ = 0;
}

uint32_t Schedule::position() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint32_t>(pos_);
}

}  // namespace lwo
