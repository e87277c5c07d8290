#include "ring.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "src/common/error.h"

namespace lwo {
namespace {

constexpr int kSlotBits = 12;
constexpr int kGenBits = 36;
constexpr uint64_t kGenMask = (uint64_t(1) << kGenBits) - 1;
constexpr size_t kMaxPendingTimings = 256;

uint64_t next_serial() {
  static std::atomic<uint64_t> counter{0};
  return (counter.fetch_add(1) % 0xffff) + 1;  // 1..65535, never 0
}

uint64_t make_id(uint64_t serial, uint32_t slot, uint64_t gen) {
  return (serial << (kSlotBits + kGenBits)) | (uint64_t(slot) << kGenBits) | (gen & kGenMask);
}

}  // namespace

namespace {
SlotSet make_slots(Pool& pool, uint32_t depth) {
  Engine& e = pool.engine();
  DeviceScope scope(e);
  try {
    return SlotSet(e.gpu(), depth, pool.max_record_bytes());
  } catch (const Error& err) {
    if (err.status() == LWO_ERR_OUT_OF_MEMORY)
      fail(LWO_ERR_OUT_OF_MEMORY, "depth %u x %llu-byte slots do not fit on device %d: %s", depth,
           static_cast<unsigned long long>(pool.max_record_bytes()), e.device(), err.what());
    throw;
  }
}
}  // namespace

Ring::Ring(Pool& pool, uint32_t depth, uint32_t flags)
    : pool_(pool), serial_(next_serial()), timing_(flags & LWO_RING_TIMING),
      slots_(make_slots(pool, depth)) {
  occ_.resize(depth);
  slot_of_layer_.assign(pool_.n_layers(), -1);
  DeviceScope scope(pool_.engine());
  pool_.source().attach(slots_.bytes());
  pool_.n_rings.fetch_add(1);
}

Ring::~Ring() {
  pool_.n_rings.fetch_sub(1);
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  try {
    DeviceScope scope(e);
    // Nothing may still write or read a slot when it is freed: fills end
    // with ready, readers before their release (free).
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (occ_[i].state != State::Empty || occ_[i].ready_elsewhere) gpu.event_sync(slots_[i].ready);
      if (slots_[i].ever_freed) gpu.event_sync(slots_[i].free);
    }
    for (EventH ev : all_events_) gpu.event_destroy(ev);
  } catch (...) {
  }
}

const char* Ring::state_name(State s) const {
  switch (s) {
    case State::Empty: return "empty";
    case State::Staged: return "staged";
    case State::Acquired: return "acquired";
    case State::Released: return "released";
  }
  return "?";
}

EventH Ring::timing_event() {
  if (!spare_events_.empty()) {
    EventH ev = spare_events_.back();
    spare_events_.pop_back();
    return ev;
  }
  EventH ev = pool_.engine().gpu().event_create(true);
  all_events_.push_back(ev);
  return ev;
}

void Ring::harvest(bool block) {
  Backend& gpu = pool_.engine().gpu();
  while (!pending_.empty()) {
    Timed& t = pending_.front();
    bool must = block || pending_.size() > kMaxPendingTimings;
    if (must) {
      gpu.event_sync(t.b);
    } else if (!gpu.event_done(t.b)) {
      break;
    }
    double ms = gpu.event_elapsed_ms(t.a, t.b);
    (t.kind == Timed::Copy ? copy_ms_ : wait_ms_) += ms;
    spare_events_.push_back(t.a);
    spare_events_.push_back(t.b);
    pending_.pop_front();
  }
}

uint64_t Ring::ticket_id(uint32_t si) const { return make_id(serial_, si, occ_[si].gen); }

int32_t Ring::choose_slot(uint32_t layer, int32_t* hit_slot) {
  pool_.layer(layer);  // range check
  pool_.source().check_readable();
  int32_t si = slot_of_layer_[layer];
  uint64_t version = pool_.version(layer);
  if (si >= 0 && occ_[si].state == State::Released && occ_[si].version != version) {
    // The host bytes changed since the copy: the slot may be reused, never hit.
    slot_of_layer_[layer] = -1;
    si = -1;
  }
  if (si >= 0) {
    const Occupancy& o = occ_[si];
    if (o.state != State::Released)
      fail(LWO_ERR_LAYER_BUSY, "layer %u is already %s in slot %d of ring depth %zu "
           "(ticket 0x%llx); release it first", layer, state_name(o.state), si,
           slots_.size(), static_cast<unsigned long long>(ticket_id(si)));
    *hit_slot = si;
    return -1;
  }
  // Miss: the free slot released longest ago (an empty one first).
  int32_t victim = slots_.pick([this](size_t i) {
    return occ_[i].state == State::Empty || occ_[i].state == State::Released;
  });
  if (victim < 0) {
    std::string held;
    for (size_t i = 0; i < slots_.size() && i < 16; ++i)
      held += strf("%sslot %zu: layer %u %s", i ? ", " : "", i, occ_[i].layer,
                   state_name(occ_[i].state));
    if (slots_.size() > 16) held += ", ...";
    fail(LWO_ERR_RING_FULL, "layer %u: ring depth %zu has no free slot (%s)", layer,
         slots_.size(), held.c_str());
  }
  return victim;
}

lwo_ticket Ring::stage(uint32_t layer) {
  // Since 0.4.0: an optimizer's update of the layer lands first (pool.h).
  if (Pool::Writer* w = pool_.writer.load()) w->wait_layer(layer);
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  // A sharded pool's stage is a collective step: under the check every rank
  // says what it will do (a copy, a hit, or an error of its own) first.
  int32_t hit_slot = -1, victim = -1;
  e.collective_step(pool_.comm(), Engine::Step::Stage, layer, [&](Engine::Step& step) {
    victim = choose_slot(layer, &hit_slot);
    step.bytes = pool_.layer(layer).layout.record_bytes;
    step.hit = hit_slot >= 0;
  });
  const Pool::Layer& l = pool_.layer(layer);
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  if (timing_) harvest(false);
  if (hit_slot >= 0) {
    // Hit: the bytes are still in the slot.
    Occupancy& o = occ_[hit_slot];
    o.state = State::Staged;
    o.gen = (o.gen + 1) & kGenMask;
    o.merge_free = true;
    ++n_stages_;
    ++n_hits_;
    return lwo_ticket{ticket_id(static_cast<uint32_t>(hit_slot))};
  }
  DeviceSlot& s = slots_[victim];
  Occupancy& o = occ_[victim];
  StreamH h2d = e.h2d();
  // Every reader of the previous occupant released on some stream before the
  // free event; the fill waits for it. A fill that completed on another
  // stream (an all-gather) is not ordered by a release without an acquire:
  // wait for its ready too.
  if (s.ever_freed) gpu.stream_wait(h2d, s.free);
  if (o.ready_elsewhere) gpu.stream_wait(h2d, s.ready);

  EventH t0 = nullptr, t1 = nullptr;
  if (timing_) {
    t0 = timing_event();
    t1 = timing_event();
    gpu.event_record(t0, h2d);
  }
  Source::Moved moved;
  try {
    moved = pool_.source().fill(l, s);
  } catch (...) {
    // The slot may now hold part of this layer: it no longer holds the old
    // one, so it must never be a hit for it.
    if (o.state == State::Released && slot_of_layer_[o.layer] == victim)
      slot_of_layer_[o.layer] = -1;
    o.state = State::Empty;
    slots_.emptied(victim);
    throw;
  }
  o.ready_elsewhere = moved.ready_elsewhere;
  if (timing_) {
    gpu.event_record(t1, h2d);
    pending_.push_back({Timed::Copy, t0, t1});
  }
  // Only now, with every enqueue done, change the table.
  if (o.state == State::Released && slot_of_layer_[o.layer] == victim)
    slot_of_layer_[o.layer] = -1;
  o.state = State::Staged;
  o.layer = layer;
  o.version = pool_.version(layer);
  o.gen = (o.gen + 1) & kGenMask;
  o.merge_free = false;
  o.tensor_ptrs.resize(l.layout.tensors.size());
  for (size_t i = 0; i < l.layout.tensors.size(); ++i)
    o.tensor_ptrs[i] = s.dev + l.layout.tensors[i].offset;
  slot_of_layer_[layer] = victim;
  ++n_stages_;
  n_copies_ += moved.n_copies;
  bytes_ += moved.bytes;
  return lwo_ticket{ticket_id(static_cast<uint32_t>(victim))};
}

void Ring::fill_view(uint32_t si, lwo_layer_view* view) {
  const Occupancy& o = occ_[si];
  const Pool::Layer& l = pool_.layer(o.layer);
  lwo_layer_view v{};
  v.size = sizeof v;
  v.layer = o.layer;
  v.n_tensors = static_cast<uint32_t>(o.tensor_ptrs.size());
  v.base = slots_[si].dev;
  v.record_bytes = l.layout.record_bytes;
  v.tensors = o.tensor_ptrs.data();
  v.tensor_bytes = l.tensor_bytes.data();
  v.tensor_dtypes = l.tensor_dtypes.data();
  *view = v;
}

uint32_t Ring::slot_of(lwo_ticket t) {
  uint64_t serial = t.id >> (kSlotBits + kGenBits);
  uint32_t slot = static_cast<uint32_t>((t.id >> kGenBits) & ((1u << kSlotBits) - 1));
  if (t.id == 0)
    fail(LWO_ERR_FOREIGN_TICKET, "ticket 0 is not a ticket (was the stage call checked?)");
  if (serial != serial_ || slot >= slots_.size())
    fail(LWO_ERR_FOREIGN_TICKET, "ticket 0x%llx was not issued by this ring (depth %zu)",
         static_cast<unsigned long long>(t.id), slots_.size());
  return slot;
}

uint32_t Ring::check_ticket(lwo_ticket t) {
  uint32_t slot = slot_of(t);
  uint64_t gen = t.id & kGenMask;
  const Occupancy& o = occ_[slot];
  if (gen != o.gen)
    fail(LWO_ERR_STALE_TICKET,
         "ticket 0x%llx is stale: slot %u has since been reused (now layer %u, %s)",
         static_cast<unsigned long long>(t.id), slot, o.layer, state_name(o.state));
  if (o.state == State::Released || o.state == State::Empty)
    fail(LWO_ERR_STALE_TICKET, "ticket 0x%llx (slot %u, layer %u) was already released",
         static_cast<unsigned long long>(t.id), slot, o.layer);
  return slot;
}

void Ring::acquire(lwo_ticket t, StreamH stream, lwo_layer_view* view) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = check_ticket(t);
  Occupancy& o = occ_[si];
  if (o.state == State::Acquired)
    fail(LWO_ERR_TICKET_STATE,
         "ticket 0x%llx (slot %u, layer %u) is already acquired; a ticket is acquired once",
         static_cast<unsigned long long>(t.id), si, o.layer);
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  EventH t0 = nullptr, t1 = nullptr;
  if (timing_) {
    t0 = timing_event();
    t1 = timing_event();
    gpu.event_record(t0, stream);
  }
  gpu.stream_wait(stream, slots_[si].ready);
  if (o.merge_free) gpu.stream_wait(stream, slots_[si].free);
  if (timing_) {
    gpu.event_record(t1, stream);
    pending_.push_back({Timed::Wait, t0, t1});
  }
  o.merge_free = false;
  o.state = State::Acquired;
  if (view) fill_view(si, view);
}

void* Ring::tensor(lwo_ticket t, const char* name) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = check_ticket(t);
  uint32_t ti = pool_.tensor_index(occ_[si].layer, name);
  return occ_[si].tensor_ptrs[ti];
}

bool Ring::landed(lwo_ticket t) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = check_ticket(t);
  DeviceScope scope(pool_.engine());
  return pool_.engine().gpu().event_done(slots_[si].ready);
}

lwo_ticket_state_t Ring::ticket_state(lwo_ticket t) {
  std::lock_guard<std::mutex> lock(mu_);
  const Occupancy& o = occ_[slot_of(t)];
  if ((t.id & kGenMask) != o.gen || o.state == State::Released || o.state == State::Empty)
    return LWO_TICKET_ENDED;
  return o.state == State::Acquired ? LWO_TICKET_ACQUIRED : LWO_TICKET_STAGED;
}

void Ring::release_locked(uint32_t si, StreamH stream) {
  Occupancy& o = occ_[si];
  Backend& gpu = pool_.engine().gpu();
  // A hit that was never acquired has not joined the previous readers yet.
  if (o.merge_free) gpu.stream_wait(stream, slots_[si].free);
  gpu.event_record(slots_[si].free, stream);
  o.merge_free = false;
  o.state = State::Released;
  slots_.freed(si);
}

void Ring::release(lwo_ticket t, StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = check_ticket(t);
  DeviceScope scope(pool_.engine());
  release_locked(si, stream);
}

uint32_t Ring::release_all(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  int ns = n_schedules.load();
  if (ns > 0)
    fail(LWO_ERR_BUSY, "%d schedule%s of the ring hold tickets of their own; destroy or reset "
         "them first", ns, ns == 1 ? "" : "s");
  DeviceScope scope(pool_.engine());
  uint32_t n = 0;
  for (uint32_t si = 0; si < slots_.size(); ++si)
    if (occ_[si].state == State::Staged || occ_[si].state == State::Acquired) {
      release_locked(si, stream);
      ++n;
    }
  return n;
}

bool Ring::layer_busy(uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer >= slot_of_layer_.size()) return false;
  int32_t si = slot_of_layer_[layer];
  return si >= 0 && occ_[si].state != State::Released;
}

void Ring::check_destroyable() {
  std::lock_guard<std::mutex> lock(mu_);
  int ns = n_schedules.load();
  if (ns > 0) fail(LWO_ERR_BUSY, "%d schedule%s of the ring still exist", ns, ns == 1 ? "" : "s");
  for (uint32_t i = 0; i < slots_.size(); ++i)
    if (occ_[i].state == State::Acquired)
      fail(LWO_ERR_BUSY, "slot %u is still acquired by layer %u (ticket 0x%llx); release it first",
           i, occ_[i].layer, static_cast<unsigned long long>(ticket_id(i)));
}

void Ring::info(lwo_ring_info* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->depth = static_cast<uint32_t>(slots_.size());
  uint32_t n_free = 0;
  for (const Occupancy& o : occ_) n_free += (o.state == State::Empty || o.state == State::Released);
  out->n_free = n_free;
  out->slot_bytes = slots_.bytes();
}

void Ring::stats(lwo_ring_stats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (timing_) {
    DeviceScope scope(pool_.engine());
    harvest(true);
  }
  out->n_stages = n_stages_;
  out->n_hits = n_hits_;
  out->n_copies = n_copies_;
  out->bytes_copied = bytes_;
  out->copy_ms = copy_ms_;
  out->wait_ms = wait_ms_;
  out->bandwidth_gbps = copy_ms_ > 0 ? static_cast<double>(bytes_) / (copy_ms_ * 1e6) : 0.0;
}

void Ring::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  if (timing_) {
    DeviceScope scope(pool_.engine());
    harvest(true);
  }
  n_stages_ = n_hits_ = n_copies_ = bytes_ = 0;
  copy_ms_ = wait_ms_ = 0;
}

}  // namespace lwo
