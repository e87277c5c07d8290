#include "ring.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "src/common/error.h"

namespace lwo {
namespace {

constexpr int kSlotBits = 12;
constexpr int kSeqBits = 16;
static_assert(kMaxDepth <= (uint32_t(1) << kSlotBits), "a ticket numbers every slot");
constexpr int kSerialBits = 64 - kSlotBits - kSeqBits;  // 36
constexpr uint64_t kSeqMask = (uint64_t(1) << kSeqBits) - 1;
constexpr uint64_t kMaxSerial = (uint64_t(1) << kSerialBits) - 1;
constexpr size_t kMaxPendingTimings = 256;

std::atomic<uint64_t> g_serials{0};

// Serials are drawn from one process-wide counter and never wrap: 2^36 - 1 of
// them (2^52 tickets), after which staging fails rather than repeat a ticket.
uint64_t next_serial() {
  uint64_t s = g_serials.fetch_add(1) + 1;  // 1.., never 0
  if (s > kMaxSerial)
    fail(LWO_ERR_OUT_OF_RANGE, "the process has used up the %llu ticket serials: a ticket "
         "would repeat", static_cast<unsigned long long>(kMaxSerial));
  return s;
}

uint64_t make_id(uint64_t serial, uint32_t slot, uint64_t seq) {
  return (serial << (kSlotBits + kSeqBits)) | (uint64_t(slot) << kSeqBits) | (seq & kSeqMask);
}

}  // namespace

namespace {

// The resident list, checked, as a per-layer index into it (-1: streamed).
std::vector<int32_t> check_resident(Pool& pool, uint32_t depth,
                                    const std::vector<uint32_t>& resident) {
  std::vector<int32_t> index(pool.n_layers(), -1);
  if (resident.empty()) return index;
  if (pool.communicator())
    fail(LWO_ERR_UNSUPPORTED, "resident layers are not supported for sharded pools (rank %d "
         "of %d): a resident layer of a sharded pool would need its all-gather at creation on "
         "every rank; stream every layer", pool.rank(), pool.n_ranks());
  if (resident.size() > kMaxDepth - depth)
    fail(LWO_ERR_INVALID_ARGUMENT, "depth %u and %zu resident layers are more than the %u "
         "slots a ring can number", depth, resident.size(), kMaxDepth);
  std::vector<size_t> first(resident.size());
  for (size_t k = 0; k < resident.size(); ++k)
    for (size_t j = 0; j < k; ++j)
      if (resident[j] == resident[k])
        fail(LWO_ERR_INVALID_ARGUMENT, "resident layer %u is listed twice (entries %zu and %zu)",
             resident[k], j, k);
  for (size_t k = 0; k < resident.size(); ++k) {
    if (resident[k] >= pool.n_layers())
      fail(LWO_ERR_OUT_OF_RANGE, "resident layer %u (entry %zu) is outside the pool's %u layers",
           resident[k], k, pool.n_layers());
    index[resident[k]] = static_cast<int32_t>(k);
  }
  return index;
}

// The ring's slots hold the largest streamed record (LWO_RECORD_ALIGN bytes
// when every layer is resident).
uint64_t streamed_slot_bytes(Pool& pool, const std::vector<int32_t>& resident_index) {
  // Without resident layers: the pool's slot size (a sharded pool's is the
  // padded shard times the ranks).
  bool none = true;
  for (int32_t i : resident_index) none &= i < 0;
  if (none) return pool.max_record_bytes();
  uint64_t b = 0;
  bool any_resident = false;
  for (uint32_t l = 0; l < pool.n_layers(); ++l) {
    if (resident_index[l] < 0)
      b = std::max(b, pool.layer(l).layout.record_bytes);
    else
      any_resident = true;
  }
  return b == 0 && any_resident ? LWO_RECORD_ALIGN : b;
}

std::vector<uint64_t> resident_sizes(Pool& pool, const std::vector<uint32_t>& resident) {
  std::vector<uint64_t> sizes;
  for (uint32_t l : resident) sizes.push_back(std::max<uint64_t>(1, pool.layer(l).layout.record_bytes));
  return sizes;
}

Charge charge_slots(Pool& pool, uint32_t depth, uint64_t bytes) {
  std::string what = strf("depth %u x %llu-byte ring slots", depth,
                          static_cast<unsigned long long>(bytes));
  return Charge(pool.engine(), MemUse::Slots, bytes, depth, what.c_str());
}

Charge charge_resident(Pool& pool, const std::vector<uint64_t>& sizes) {
  Engine& e = pool.engine();
  Charge all;
  uint64_t total = 0;
  for (uint64_t b : sizes) total += device_footprint(b);
  if (sizes.empty()) return all;
  std::string what = strf("%zu resident layers (%llu bytes)", sizes.size(),
                          static_cast<unsigned long long>(total));
  // One charge for the whole set: the footprint of each, summed.
  return Charge(e, MemUse::Resident, total, 1, what.c_str());
}

SlotSet make_slots(Pool& pool, const std::vector<uint64_t>& sizes, const std::string& what) {
  Engine& e = pool.engine();
  DeviceScope scope(e);
  try {
    return SlotSet(e.gpu(), sizes);
  } catch (const Error& err) {
    uint64_t total = 0;
    for (uint64_t b : sizes) total += b;
    if (err.status() == LWO_ERR_OUT_OF_MEMORY)
      fail(LWO_ERR_OUT_OF_MEMORY, "%s (%llu bytes) do not fit on device %d: %s", what.c_str(),
           static_cast<unsigned long long>(total), e.device(), err.what());
    throw;
  }
}
}  // namespace

Ring::Ring(Pool& pool, uint32_t depth, uint32_t flags, const std::vector<uint32_t>& resident)
    : pool_(pool), serial_(next_serial()), timing_(flags & LWO_RING_TIMING),
      checking_(pool.engine().checking()),
      resident_index_(check_resident(pool, depth, resident)),
      slot_charge_(charge_slots(pool, depth, streamed_slot_bytes(pool, resident_index_))),
      slots_(make_slots(pool, std::vector<uint64_t>(depth, streamed_slot_bytes(pool, resident_index_)),
                        strf("depth %u x %llu-byte slots", depth, static_cast<unsigned long long>(
                                 streamed_slot_bytes(pool, resident_index_))))),
      resident_charge_(charge_resident(pool, resident_sizes(pool, resident))),
      resident_(make_slots(pool, resident_sizes(pool, resident),
                           strf("slots of %zu resident layers", resident.size()))) {
  warm_ = (flags & LWO_RING_CAPTURE_WARM) != 0;
  occ_.resize(depth + resident.size());
  slot_of_layer_.assign(pool_.n_layers(), -1);
  DeviceScope scope(pool_.engine());
  // Staged sources size their staging buffers to the largest record filled.
  pool_.source().attach(std::max(slots_.bytes(), resident_.bytes()));
  try {
    // Resident layers go up once, now; their slots are then released copies
    // of their layers, so the first stage is already a hit.
    for (size_t k = 0; k < resident.size(); ++k) {
      uint32_t si = depth + static_cast<uint32_t>(k);
      fill_slot(si, resident[k]);
      occ_[si].state = State::Released;
    }
  } catch (...) {
    // The slots are freed on the way out: no copy may still write them.
    try {
      pool_.engine().gpu().stream_sync(pool_.engine().h2d());
    } catch (...) {
    }
    for (EventH ev : all_events_) pool_.engine().gpu().event_destroy(ev);
    throw;
  }
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
    for (uint32_t i = 0; i < occ_.size(); ++i) {
      if (occ_[i].state != State::Empty || occ_[i].ready_elsewhere) gpu.event_sync(slot(i).ready);
      if (slot(i).ever_freed) gpu.event_sync(slot(i).free);
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

uint64_t Ring::ticket_id(uint32_t si) const { return occ_[si].id; }

uint64_t Ring::new_ticket_id(uint32_t si) {
  if (seq_ == kSeqMask) {
    uint64_t next = next_serial();
    old_serials_.push_back(serial_);
    serial_ = next;
    seq_ = 0;
  }
  return make_id(serial_, si, ++seq_);
}

int32_t Ring::choose_slot(uint32_t layer, int32_t* hit_slot) {
  pool_.layer(layer);  // range check
  pool_.source().check_readable();
  uint64_t version = pool_.version(layer);
  if (is_resident(layer)) {
    uint32_t ri = static_cast<uint32_t>(slots_.size()) + static_cast<uint32_t>(resident_index_[layer]);
    const Occupancy& o = occ_[ri];
    if (o.state == State::Staged || o.state == State::Acquired)
      fail(LWO_ERR_LAYER_BUSY, "layer %u is already %s in its resident slot %u of the ring "
           "(ticket 0x%llx); release it first", layer, state_name(o.state), ri,
           static_cast<unsigned long long>(ticket_id(ri)));
    // Changed since its upload (or a failed upload): fill the same slot again.
    // In a capture a resident layer is a hit whatever its version: each launch
    // uploads a change before the replay (refresh_resident).
    if (o.state == State::Empty || (!capture_stream_ && o.version != version))
      return static_cast<int32_t>(ri);
    *hit_slot = static_cast<int32_t>(ri);
    return -1;
  }
  int32_t si = slot_of_layer_[layer];
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
  // An optimizer's update of the layer lands first (pool.h).
  if (Pool::Writer* w = pool_.writer.load()) w->wait_layer(layer);
  std::lock_guard<std::mutex> lock(mu_);
  check_not_bound("staging a layer");
  Engine& e = pool_.engine();
  // A sharded pool's stage is a collective step: under the check every rank
  // says what it will do (a copy, a hit, or an error of its own) first.
  int32_t hit_slot = -1, victim = -1;
  e.collective_step(pool_.communicator(), Engine::Step::Stage, layer, [&](Engine::Step& step) {
    victim = choose_slot(layer, &hit_slot);
    step.bytes = pool_.layer(layer).layout.record_bytes;
    step.hit = hit_slot >= 0;
  });
  DeviceScope scope(e);
  if (timing_) harvest(false);
  if (capture_stream_) captured_layers_.push_back(layer);
  if (hit_slot >= 0) {
    // Hit: the bytes are still in the slot (a resident slot: always).
    Occupancy& o = occ_[hit_slot];
    const uint64_t id = new_ticket_id(static_cast<uint32_t>(hit_slot));
    o.state = State::Staged;
    o.id = id;
    o.merge_free = slot(static_cast<uint32_t>(hit_slot)).ever_freed;
    ++n_stages_;
    ++n_hits_;
    if (static_cast<uint32_t>(hit_slot) >= slots_.size()) ++n_resident_hits_;
    // A resident layer the graph reads as it was before the capture, or a
    // slot a warm capture kept (each launch first makes it hold the layer).
    if (capture_stream_ && o.ready_outside) {
      const uint32_t si = static_cast<uint32_t>(hit_slot);
      if (si >= slots_.size()) {
        captured_resident_.push_back(layer);
      } else if (std::none_of(captured_warm_.begin(), captured_warm_.end(),
                              [&](const WarmSlot& w) { return w.slot == si; })) {
        captured_warm_.push_back({si, layer, kNoLayer, layer, o.version});
      }
    }
    return lwo_ticket{ticket_id(static_cast<uint32_t>(hit_slot))};
  }
  fill_slot(static_cast<uint32_t>(victim), layer);
  ++n_stages_;
  return lwo_ticket{ticket_id(static_cast<uint32_t>(victim))};
}

void Ring::fill_slot(uint32_t si, uint32_t layer) {
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  const Pool::Layer& l = pool_.layer(layer);
  DeviceSlot& s = slot(si);
  Occupancy& o = occ_[si];
  const bool resident = si >= slots_.size();
  const uint64_t id = new_ticket_id(si);  // first: it is all that can fail here
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
    if (!resident && o.state == State::Released && slot_of_layer_[o.layer] == static_cast<int32_t>(si))
      slot_of_layer_[o.layer] = -1;
    o.state = State::Empty;
    o.ready_outside = false;
    slot_emptied(si);
    throw;
  }
  o.ready_elsewhere = moved.ready_elsewhere;
  if (timing_) {
    gpu.event_record(t1, h2d);
    pending_.push_back({Timed::Copy, t0, t1});
  }
  // Only now, with every enqueue done, change the table.
  if (!resident) {
    if (o.state == State::Released && slot_of_layer_[o.layer] == static_cast<int32_t>(si))
      slot_of_layer_[o.layer] = -1;
    slot_of_layer_[layer] = static_cast<int32_t>(si);
  }
  o.state = State::Staged;
  o.layer = layer;
  o.version = pool_.version(layer);
  o.id = id;
  o.merge_free = false;
  o.ready_outside = false;
  o.tensor_ptrs.resize(l.layout.tensors.size());
  for (size_t i = 0; i < l.layout.tensors.size(); ++i)
    o.tensor_ptrs[i] = s.dev + l.layout.tensors[i].offset;
  n_copies_ += moved.n_copies;
  bytes_ += moved.bytes;
  if (resident) {
    ++n_resident_uploads_;
    resident_bytes_ += moved.bytes;
  }
}

void Ring::fill_view(uint32_t si, lwo_layer_view* view) {
  const Occupancy& o = occ_[si];
  const Pool::Layer& l = pool_.layer(o.layer);
  lwo_layer_view v{};
  v.size = sizeof v;
  v.layer = o.layer;
  v.n_tensors = static_cast<uint32_t>(o.tensor_ptrs.size());
  v.base = slot(si).dev;
  v.record_bytes = l.layout.record_bytes;
  v.tensors = o.tensor_ptrs.data();
  v.tensor_bytes = l.tensor_bytes.data();
  v.tensor_dtypes = l.tensor_dtypes.data();
  *view = v;
}

uint32_t Ring::slot_of(lwo_ticket t) {
  uint64_t serial = t.id >> (kSlotBits + kSeqBits);
  uint32_t slot = static_cast<uint32_t>((t.id >> kSeqBits) & ((1u << kSlotBits) - 1));
  if (t.id == 0)
    fail(LWO_ERR_FOREIGN_TICKET, "ticket 0 is not a ticket (was the stage call checked?)");
  bool ours = serial == serial_ ||
              std::binary_search(old_serials_.begin(), old_serials_.end(), serial);
  if (!ours || slot >= occ_.size())
    fail(LWO_ERR_FOREIGN_TICKET, "ticket 0x%llx was not issued by this ring (depth %zu)",
         static_cast<unsigned long long>(t.id), slots_.size());
  return slot;
}

uint32_t Ring::check_ticket(lwo_ticket t) {
  uint32_t slot = slot_of(t);
  const Occupancy& o = occ_[slot];
  if (t.id != o.id)
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
  check_not_bound("acquiring a ticket");
  uint32_t si = check_ticket(t);
  Occupancy& o = occ_[si];
  if (o.state == State::Acquired)
    fail(LWO_ERR_TICKET_STATE,
         "ticket 0x%llx (slot %u, layer %u) is already acquired; a ticket is acquired once",
         static_cast<unsigned long long>(t.id), si, o.layer);
  // A copy that found its file cut short: the slot's bytes are not the
  // layer's (once that copy ran; on a GPU it may run after this call).
  pool_.source().check_copies();
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  EventH t0 = nullptr, t1 = nullptr;
  if (timing_) {
    t0 = timing_event();
    t1 = timing_event();
    gpu.event_record(t0, stream);
  }
  // A resident slot filled before the capture (the host waited for it) is
  // ready for every replay: a launch orders its own uploads (refresh_resident).
  if (!(capture_stream_ && o.ready_outside)) gpu.stream_wait(stream, slot(si).ready);
  if (o.merge_free) gpu.stream_wait(stream, slot(si).free);
  if (timing_) {
    gpu.event_record(t1, stream);
    pending_.push_back({Timed::Wait, t0, t1});
  }
  gpu.slot_reclaimed(slot(si).dev, pool_.layer(o.layer).layout.record_bytes, stream);
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
  if (capture_stream_)
    fail(LWO_ERR_CAPTURING, "the ring is capturing a CUDA graph: a copy's landing cannot be "
         "queried until the graph is launched");
  check_not_bound("querying a ticket");
  uint32_t si = check_ticket(t);
  DeviceScope scope(pool_.engine());
  return pool_.engine().gpu().event_done(slot(si).ready);
}

lwo_ticket_state_t Ring::ticket_state(lwo_ticket t) {
  std::lock_guard<std::mutex> lock(mu_);
  const Occupancy& o = occ_[slot_of(t)];
  if (t.id != o.id || o.state == State::Released || o.state == State::Empty)
    return LWO_TICKET_ENDED;
  return o.state == State::Acquired ? LWO_TICKET_ACQUIRED : LWO_TICKET_STAGED;
}

void Ring::release_locked(uint32_t si, StreamH stream) {
  Occupancy& o = occ_[si];
  Backend& gpu = pool_.engine().gpu();
  // A hit that was never acquired has not joined the previous readers yet.
  if (o.merge_free) gpu.stream_wait(stream, slot(si).free);
  if (checking_) {
    // Checking mode: the record is overwritten with the pattern after every
    // read ordered before the release (and after the fill, which a ticket
    // released unacquired has not waited for); the free event covers it.
    if (!(capture_stream_ && o.ready_outside)) gpu.stream_wait(stream, slot(si).ready);
    const uint64_t bytes = pool_.layer(o.layer).layout.record_bytes;
    if (bytes) gpu.fill_device(slot(si).dev, kCheckingByte, bytes, stream);
  }
  gpu.event_record(slot(si).free, stream);
  gpu.slot_released(slot(si).dev, pool_.layer(o.layer).layout.record_bytes, stream);
  o.merge_free = false;
  o.state = State::Released;
  slot_freed(si);
  if (checking_) {
    // The slot no longer holds the layer: the next stage fills it again.
    if (si < slots_.size() && slot_of_layer_[o.layer] == static_cast<int32_t>(si))
      slot_of_layer_[o.layer] = -1;
    o.state = State::Empty;
  }
}

void Ring::release(lwo_ticket t, StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_not_bound("releasing a ticket");
  uint32_t si = check_ticket(t);
  DeviceScope scope(pool_.engine());
  release_locked(si, stream);
}

uint32_t Ring::release_all(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_not_bound("releasing the tickets");
  int ns = n_schedules.load();
  if (ns > 0)
    fail(LWO_ERR_BUSY, "%d schedule%s of the ring hold tickets of their own; destroy or reset "
         "them first", ns, ns == 1 ? "" : "s");
  DeviceScope scope(pool_.engine());
  uint32_t n = 0;
  for (uint32_t si = 0; si < occ_.size(); ++si)
    if (occ_[si].state == State::Staged || occ_[si].state == State::Acquired) {
      release_locked(si, stream);
      ++n;
    }
  return n;
}

bool Ring::layer_busy(uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer >= slot_of_layer_.size()) return false;
  int32_t si = is_resident(layer) ? static_cast<int32_t>(slots_.size()) + resident_index_[layer]
                                  : slot_of_layer_[layer];
  return si >= 0 && (occ_[si].state == State::Staged || occ_[si].state == State::Acquired);
}

void Ring::check_destroyable() {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_stream_ && joined_)
    fail(LWO_ERR_BUSY, "the ring is in a CUDA graph capture it joined; leave it first "
         "(lwo_ring_capture_leave)");
  if (capture_stream_)
    fail(LWO_ERR_BUSY, "the ring is capturing a CUDA graph; end the capture first "
         "(lwo_ring_capture_end)");
  if (bound_ && joined_)
    fail(LWO_ERR_BUSY, "a CUDA graph the caller captured holds the ring "
         "(lwo_ring_capture_leave); give it back first (lwo_ring_capture_release)");
  if (bound_)
    fail(LWO_ERR_BUSY, "a CUDA graph of the ring exists (lwo_ring_capture_end); destroy it "
         "first (lwo_graph_destroy)");
  int ns = n_schedules.load();
  if (ns > 0) fail(LWO_ERR_BUSY, "%d schedule%s of the ring still exist", ns, ns == 1 ? "" : "s");
  for (uint32_t i = 0; i < occ_.size(); ++i)
    if (occ_[i].state == State::Acquired)
      fail(LWO_ERR_BUSY, "slot %u is still acquired by layer %u (ticket 0x%llx); release it first",
           i, occ_[i].layer, static_cast<unsigned long long>(ticket_id(i)));
}

void Ring::info(lwo_ring_info* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->depth = static_cast<uint32_t>(slots_.size());
  uint32_t n_free = 0;
  for (size_t i = 0; i < slots_.size(); ++i)
    n_free += (occ_[i].state == State::Empty || occ_[i].state == State::Released);
  out->n_free = n_free;
  out->slot_bytes = slots_.bytes();
  out->n_resident = static_cast<uint32_t>(resident_.size());
  uint64_t rb = 0;
  for (size_t k = 0; k < resident_.size(); ++k)
    rb += pool_.layer(occ_[slots_.size() + k].layer).layout.record_bytes;
  out->resident_bytes = rb;
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
  out->n_resident_hits = n_resident_hits_;
  out->n_resident_uploads = n_resident_uploads_;
  out->resident_bytes_uploaded = resident_bytes_;
}

void Ring::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  if (timing_) {
    DeviceScope scope(pool_.engine());
    harvest(true);
  }
  n_stages_ = n_hits_ = n_copies_ = bytes_ = 0;
  n_resident_hits_ = n_resident_uploads_ = resident_bytes_ = 0;
  copy_ms_ = wait_ms_ = 0;
}

// ---- CUDA graph capture ----

void Ring::check_not_bound(const char* what) const {
  if (bound_ && joined_)
    fail(LWO_ERR_BUSY, "%s: the ring belongs to a CUDA graph the caller captured "
         "(lwo_ring_capture_leave) until lwo_ring_capture_release", what);
  if (bound_)
    fail(LWO_ERR_BUSY, "%s: the ring belongs to a CUDA graph (lwo_ring_capture_end) until "
         "lwo_graph_destroy", what);
  check_not_captured_elsewhere(what);
}

void Ring::check_not_captured_elsewhere(const char* what) const {
  pool_.engine().check_left_capture(what);
  const void* owner = pool_.engine().capture_owner();
  if (owner && owner != this) {
    if (pool_.engine().capture_joined())
      fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine has joined a CUDA graph capture and the "
           "transfer stream is part of it; leave it first (lwo_ring_capture_leave)", what, owner);
    fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine is capturing a CUDA graph and the "
         "transfer stream is part of its capture; end it first (lwo_ring_capture_end)", what,
         owner);
  }
}

const char* Ring::schedules_hint() const {
  return n_schedules.load() > 0 ? " (a schedule holds its tickets until lwo_schedule_reset or "
                                  "its LWO_END)" : "";
}

void Ring::forget_slots() {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    Occupancy& o = occ_[i];
    o.state = State::Empty;
    o.merge_free = false;
    o.ready_elsewhere = false;
    o.ready_outside = false;
    slots_[i].ever_freed = false;
    slots_.emptied(i);
  }
  std::fill(slot_of_layer_.begin(), slot_of_layer_.end(), -1);
  table_epoch_.fetch_add(1);
}

void Ring::slots_into_capture() {
  captured_warm_.clear();
  if (!warm_ || checking_) {
    forget_slots();
    return;
  }
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    Occupancy& o = occ_[i];
    // prepare_capture refused live tickets: a slot is empty or released.
    const bool keep = o.state == State::Released && o.version == pool_.version(o.layer);
    o.merge_free = false;
    o.ready_elsewhere = false;
    o.ready_outside = keep;        // copied and waited for
    slots_[i].ever_freed = false;  // the host waited for every reader
    if (keep) continue;
    if (o.state != State::Empty && slot_of_layer_[o.layer] == static_cast<int32_t>(i))
      slot_of_layer_[o.layer] = -1;
    o.state = State::Empty;
    slots_.emptied(i);
  }
  table_epoch_.fetch_add(1);
}

void Ring::restore_warm() {
  for (const WarmSlot& w : captured_warm_) {
    Occupancy& o = occ_[w.slot];
    if (o.state != State::Empty && o.layer == w.layer) continue;
    fill_slot(w.slot, w.layer);  // after the slot's last reader in the capture
    o.state = State::Released;
  }
}

std::vector<WarmSlot> Ring::warm_of_capture() const {
  std::vector<WarmSlot> warm = captured_warm_;
  for (WarmSlot& w : warm)
    w.end_layer = occ_[w.slot].state == State::Empty ? kNoLayer : occ_[w.slot].layer;
  return warm;
}

void Ring::resident_into_capture() {
  for (uint32_t k = 0; k < resident_.size(); ++k) {
    Occupancy& o = occ_[slots_.size() + k];
    resident_[k].ever_freed = false;  // the host waited for every reader
    o.merge_free = false;
    if (checking_) {
      // Releases poison the slot: every replay must fill it itself.
      o.state = State::Empty;
      o.ready_outside = false;
    } else {
      o.ready_outside = o.state != State::Empty;  // uploaded and waited for
    }
  }
}

void Ring::resident_out_of_capture() {
  for (uint32_t k = 0; k < resident_.size(); ++k) {
    Occupancy& o = occ_[slots_.size() + k];
    // Its free event (and, in checking mode, its ready) was last recorded in
    // the capture: later work is ordered by the capture's or the graph's end.
    resident_[k].ever_freed = false;
    o.merge_free = false;
    o.ready_outside = false;
    // Tickets of a discarded capture end; outside checking mode the slot
    // still holds what was uploaded before the capture (a capture fills no
    // resident slot then).
    if (o.state == State::Staged || o.state == State::Acquired) o.state = State::Released;
    if (checking_) o.state = State::Empty;
  }
}

void Ring::hold_resident(int delta) {
  for (uint32_t l = 0; l < resident_index_.size(); ++l)
    if (resident_index_[l] >= 0) pool_.hold(l, delta);
}

void Ring::prepare_capture(StreamH stream, const char* what, bool join) {
  Engine& e = pool_.engine();
  if (!stream)
    fail(LWO_ERR_INVALID_ARGUMENT, "stream is NULL: the legacy default stream cannot be captured");
  check_not_bound(what);
  if (capture_stream_ || e.capture_owner())
    fail(LWO_ERR_CAPTURING, "ring %p of the engine is already %s", e.capture_owner(),
         e.capture_joined() ? "in a CUDA graph capture it joined" : "capturing a CUDA graph");
  if (timing_)
    fail(LWO_ERR_UNSUPPORTED, "a ring made with LWO_RING_TIMING cannot be captured: its timing "
         "events are read on the host");
  if (pool_.kind() == LWO_POOL_CHECKPOINT_STAGED || pool_.kind() == LWO_POOL_SHARDED)
    fail(LWO_ERR_UNSUPPORTED, "a ring of a %s pool cannot be captured: its copies are packed "
         "by host threads or gathered by a collective",
         pool_.kind() == LWO_POOL_SHARDED ? "sharded" : "staged checkpoint");
  // The ring's schedules may drive the capture; they hold no ticket now.
  for (uint32_t i = 0; i < occ_.size(); ++i)
    if (occ_[i].state == State::Staged || occ_[i].state == State::Acquired)
      fail(LWO_ERR_BUSY, "slot %u holds layer %u %s (ticket 0x%llx); release every ticket "
           "before a capture%s", i, occ_[i].layer, state_name(occ_[i].state),
           static_cast<unsigned long long>(ticket_id(i)), schedules_hint());
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  const Backend::CaptureStatus status = gpu.capture_status(stream);
  if (join && status == Backend::CaptureStatus::None)
    fail(LWO_ERR_CAPTURING, "stream %p is not capturing: begin the capture on it first "
         "(cudaStreamBeginCapture), or let the ring capture a graph of its own "
         "(lwo_ring_capture_begin)", stream);
  if (join && status == Backend::CaptureStatus::Invalidated)
    fail(LWO_ERR_CAPTURING, "the capture on stream %p was invalidated by an earlier call; end it "
         "(cudaStreamEndCapture) and capture again", stream);
  if (!join && status != Backend::CaptureStatus::None)
    fail(LWO_ERR_CAPTURING, "stream %p is already capturing (a capture the caller began): join "
         "it with lwo_ring_capture_join", stream);
  // The host waits below are of nothing in the caller's capture (the backend
  // makes them with the thread's capture mode relaxed).
  // Resident layers changed since their upload (or whose upload failed) go
  // up now, outside the capture: a captured stage of one is a hit.
  if (!checking_)
    for (uint32_t k = 0; k < resident_.size(); ++k) {
      const uint32_t si = static_cast<uint32_t>(slots_.size()) + k;
      Occupancy& o = occ_[si];
      if (o.state != State::Empty && o.version == pool_.version(o.layer)) continue;
      fill_slot(si, o.layer);
      o.state = State::Released;
    }
  // Nothing of the ring may still run: the capture takes its slots as empty.
  for (uint32_t i = 0; i < occ_.size(); ++i) {
    if (occ_[i].state != State::Empty || occ_[i].ready_elsewhere) gpu.event_sync(slot(i).ready);
    if (slot(i).ever_freed) gpu.event_sync(slot(i).free);
  }
  if (!capture_event_) {
    capture_event_ = gpu.event_create(false);
    all_events_.push_back(capture_event_);
  }
}

// An optimizer's update of a resident layer lands before the capture's
// upload of it (as before a stage).
static void wait_resident_writers(Pool& pool, const std::vector<int32_t>& resident_index) {
  if (Pool::Writer* w = pool.writer.load())
    for (uint32_t l = 0; l < resident_index.size(); ++l)
      if (resident_index[l] >= 0) w->wait_layer(l);
}

void Ring::capture_begin(StreamH stream) {
  wait_resident_writers(pool_, resident_index_);
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  prepare_capture(stream, "beginning a capture", /*join=*/false);
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  gpu.capture_begin(stream);
  try {
    gpu.event_record(capture_event_, stream);
    gpu.stream_wait(e.h2d(), capture_event_);  // the transfer stream joins the capture
  } catch (...) {
    try {
      gpu.graph_destroy(gpu.capture_end(stream));
    } catch (...) {
    }
    throw;
  }
  slots_into_capture();
  resident_into_capture();
  captured_layers_.clear();
  captured_resident_.clear();
  capture_stream_ = stream;
  joined_ = false;
  e.take_capture_parts();  // none: the last capture took its own
  e.set_capture_owner(this, &pool_);
}

void Ring::capture_join(StreamH stream) {
  wait_resident_writers(pool_, resident_index_);
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  prepare_capture(stream, "joining a capture", /*join=*/true);
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  // The transfer stream joins the caller's capture (if the wait fails, the
  // record left in the caller's capture orders nothing).
  gpu.event_record(capture_event_, stream);
  gpu.stream_wait(e.h2d(), capture_event_);
  slots_into_capture();
  resident_into_capture();
  captured_layers_.clear();
  captured_resident_.clear();
  capture_stream_ = stream;
  joined_ = true;
  hold_resident(+1);
  e.take_capture_parts();
  e.set_capture_owner(this, &pool_, /*joined=*/true);
}

void Ring::capture_leave(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  if (!capture_stream_)
    fail(LWO_ERR_CAPTURING, "the ring is in no capture (lwo_ring_capture_join)");
  if (!joined_)
    fail(LWO_ERR_CAPTURING, "the ring captures a graph of its own (lwo_ring_capture_begin): end "
         "it with lwo_ring_capture_end");
  if (stream != capture_stream_)
    fail(LWO_ERR_INVALID_ARGUMENT, "stream %p is not the stream %p the ring joined the capture "
         "on", stream, capture_stream_);
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  const Backend::CaptureStatus status = gpu.capture_status(stream);
  if (status != Backend::CaptureStatus::Active) {
    // The caller's capture ended, or failed, without the ring: nothing of the
    // ring's part runs, and the ring stages eagerly again.
    capture_stream_ = nullptr;
    joined_ = false;
    // An invalidated capture is still under way (with the engine's streams)
    // until the caller ends it: the engine's work waits for that, as after
    // a leave; set first, so that no call finds neither.
    if (status == Backend::CaptureStatus::Invalidated) e.set_left_capture(this);
    e.set_capture_owner(nullptr);
    const std::vector<CapturePart*> parts = e.take_capture_parts();
    forget_slots();
    resident_out_of_capture();
    hold_resident(-1);
    if (status == Backend::CaptureStatus::None) {
      try {  // later fills after the stream's work
        gpu.event_record(capture_event_, stream);
        gpu.stream_wait(e.h2d(), capture_event_);
      } catch (...) {
      }
    }
    // The gradient sets drop their part too (an invalidated capture is still
    // under way: nothing is ordered on its stream).
    for (CapturePart* p : parts)
      p->ended(false, status == Backend::CaptureStatus::None ? stream : nullptr);
    fail(LWO_ERR_CAPTURING, "the capture on stream %p %s before lwo_ring_capture_leave: the "
         "ring's part of it is dropped, its tickets ended, and the ring stages eagerly again%s",
         stream, status == Backend::CaptureStatus::None ? "ended" : "was invalidated",
         status == Backend::CaptureStatus::None ? "" : " once the caller ends the capture");
  }
  for (uint32_t i = 0; i < occ_.size(); ++i)
    if (occ_[i].state == State::Staged || occ_[i].state == State::Acquired)
      fail(LWO_ERR_TICKET_STATE, "slot %u holds layer %u %s (ticket 0x%llx): release every "
           "ticket in the capture, then leave it (the capture is the caller's: the ring cannot "
           "discard it)%s", i, occ_[i].layer, state_name(occ_[i].state),
           static_cast<unsigned long long>(ticket_id(i)), schedules_hint());
  // The gradient sets of the capture: a layer begun and not ended is refused
  // as a live ticket is (they stay in the capture).
  std::vector<CapturePart*> parts = e.take_capture_parts();
  for (CapturePart* p : parts) {
    const std::string live = p->live();
    if (live.empty()) continue;
    for (CapturePart* q : parts) e.join_capture(q);
    fail(LWO_ERR_TICKET_STATE, "%s: end it in the capture, then leave it (the capture is the "
         "caller's: the ring cannot discard it)", live.c_str());
  }
  std::unique_ptr<Graph> g;
  try {
    restore_warm();
    if (!joined_done_) {
      joined_done_ = gpu.event_create(false);
      all_events_.push_back(joined_done_);
    }
    gpu.event_record(capture_event_, e.h2d());
    gpu.stream_wait(stream, capture_event_);  // the transfer stream leaves the capture
    for (CapturePart* p : parts) p->join_back(stream);
    // The replay's end for the host and the next replay: a node of the
    // caller's graph (the caller launches it after capture_replay, so no
    // event lwo records then could follow it). Only with participants, or
    // with slots a warm capture kept (the next launch fills them after it):
    // a forward pass's replays need no host work after them.
    std::vector<WarmSlot> warm = warm_of_capture();
    if (!parts.empty() || !warm.empty()) gpu.event_record_in_graph(joined_done_, stream);
    g = std::make_unique<Graph>(*this, nullptr, captured_layers_, captured_resident_,
                                std::move(warm), parts, joined_done_);
  } catch (...) {
    for (CapturePart* p : parts) e.join_capture(p);  // still in the capture
    throw;
  }
  capture_stream_ = nullptr;
  // Until the caller ends its capture; set before the owner is cleared, so
  // that no call finds neither.
  e.set_left_capture(this);
  e.set_capture_owner(nullptr);
  resident_out_of_capture();
  bound_ = true;  // the caller's graph holds the ring (joined_ says whose)
  joined_graph_ = std::move(g);
  // The capture goes on (the caller's): the sets' host state is the join's
  // again, and the graph holds them until the release.
  for (CapturePart* p : parts) p->ended(true, nullptr);
}

void Ring::capture_replay(StreamH stream) {
  Graph* g = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!bound_ || !joined_)
      fail(LWO_ERR_CAPTURING, "%s", bound_ ? "the ring belongs to a CUDA graph of its own "
           "(lwo_ring_capture_end): lwo_graph_launch replays it"
           : capture_stream_ && joined_ ? "the ring is still in the caller's capture: leave it "
           "(lwo_ring_capture_leave) and end the capture before launching its graph"
           : "the ring belongs to no CUDA graph the caller captured (lwo_ring_capture_join, "
           "lwo_ring_capture_leave)");
    g = joined_graph_.get();
  }
  // Outside mu_: the replay's host side takes it (refresh_resident) and waits
  // (the pool's writer, the optimizer's reads); the graph stays until the
  // release, which the caller's thread does not run meanwhile.
  g->replay(stream, "announcing a replay", [](Graph&, StreamH) {});
}

void Ring::capture_release(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  if (!bound_ || !joined_)
    fail(LWO_ERR_CAPTURING, "%s", bound_ ? "the ring belongs to a CUDA graph of its own "
         "(lwo_ring_capture_end): lwo_graph_destroy gives it back"
         : capture_stream_ && joined_ ? "the ring is still in the caller's capture: leave it "
         "first (lwo_ring_capture_leave)" : "the ring belongs to no CUDA graph the caller "
         "captured (lwo_ring_capture_join, lwo_ring_capture_leave)");
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  if (stream && gpu.capture_status(stream) != Backend::CaptureStatus::None)
    fail(LWO_ERR_CAPTURING, "stream %p is capturing: the release orders the ring's later work "
         "after the stream's, which must run outside any capture", stream);
  // The caller's capture must have ended, and no other may be under way: the
  // transfer stream waits for the release below.
  e.check_not_capturing("releasing the ring");
  gpu.event_record(capture_event_, stream);
  // The gradient sets of the graph (if any) after the last replay's host work.
  if (joined_graph_) joined_graph_->release_joined(capture_event_);
  joined_graph_.reset();
  give_back(capture_event_, nullptr);
  joined_ = false;
  hold_resident(-1);
  e.forget_left_capture(this);
}

std::unique_ptr<Graph> Ring::capture_end(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  if (!capture_stream_)
    fail(LWO_ERR_CAPTURING, "the ring is not capturing (lwo_ring_capture_begin)");
  if (joined_)
    fail(LWO_ERR_CAPTURING, "the ring joined a capture the caller began (lwo_ring_capture_join): "
         "leave it with lwo_ring_capture_leave; the caller ends the capture");
  if (stream != capture_stream_)
    fail(LWO_ERR_INVALID_ARGUMENT, "stream %p is not the stream %p the capture began on", stream,
         capture_stream_);
  std::string live;
  for (uint32_t i = 0; i < occ_.size() && live.empty(); ++i)
    if (occ_[i].state == State::Staged || occ_[i].state == State::Acquired)
      live = strf("a ticket not released (slot %u holds layer %u %s)", i, occ_[i].layer,
                  state_name(occ_[i].state));
  const char* hint = live.empty() ? "" : schedules_hint();
  // The participants (gradient sets) end with the capture, whatever happens.
  const std::vector<CapturePart*> parts = e.take_capture_parts();
  for (CapturePart* p : parts)
    if (live.empty()) live = p->live();
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  // Whatever happens, the capture ends here and the ring is taken as empty
  // (nothing it captured ever runs unless the graph is launched).
  auto leave = [&] {
    capture_stream_ = nullptr;
    e.set_capture_owner(nullptr);
    forget_slots();
    resident_out_of_capture();
    // The next fills come after the stream's work (nothing of the discarded
    // capture runs; this orders them for a checking backend as well).
    try {
      gpu.event_record(capture_event_, stream);
      gpu.stream_wait(e.h2d(), capture_event_);
    } catch (...) {
    }
    for (CapturePart* p : parts) p->ended(false, stream);
  };
  void* exec = nullptr;
  try {
    if (live.empty()) restore_warm();
    gpu.event_record(capture_event_, e.h2d());
    gpu.stream_wait(stream, capture_event_);  // the transfer stream leaves the capture
    for (CapturePart* p : parts) p->join_back(stream);
    exec = gpu.capture_end(stream);
  } catch (...) {
    try {
      if (!exec) gpu.graph_destroy(gpu.capture_end(stream));
    } catch (...) {
    }
    leave();
    throw;
  }
  if (!live.empty()) {
    gpu.graph_destroy(exec);
    leave();
    fail(LWO_ERR_TICKET_STATE, "the capture ended with %s: it is discarded and its tickets and "
         "gradient layers ended; release every ticket and end every gradient layer before "
         "lwo_ring_capture_end%s", live.c_str(), hint);
  }
  std::unique_ptr<Graph> g;
  try {
    g = std::make_unique<Graph>(*this, exec, captured_layers_, captured_resident_,
                                warm_of_capture(), parts);
  } catch (...) {
    gpu.graph_destroy(exec);
    leave();
    throw;
  }
  capture_stream_ = nullptr;
  e.set_capture_owner(nullptr);
  resident_out_of_capture();
  bound_ = true;  // the table holds what every replay leaves in the slots
  for (CapturePart* p : parts) p->ended(true, stream);  // the graph holds them now
  gpu.event_record(capture_event_, stream);  // after the capture: graph_released's order
  return g;
}

void Ring::give_back(EventH after, EventH last_launch) {
  Engine& e = pool_.engine();
  try {
    DeviceScope scope(e);
    // The slots' last readers are the graph's (its launches, done by now):
    // fills after it are ordered after them on the transfer stream too (no
    // capture is under way: lwo_graph_destroy and lwo_ring_capture_release
    // refuse then).
    e.gpu().stream_wait(e.h2d(), after);
    if (last_launch) e.gpu().stream_wait(e.h2d(), last_launch);
  } catch (...) {
  }
  forget_slots();
  resident_out_of_capture();
  bound_ = false;
}

void Ring::graph_released(EventH last_launch) {
  std::lock_guard<std::mutex> lock(mu_);
  give_back(capture_event_, last_launch);
}

void Ring::refresh_resident(const std::vector<uint32_t>& layers, StreamH stream,
                            EventH last_launch) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  bool ordered = false;
  for (uint32_t l : layers) {
    const uint32_t si = static_cast<uint32_t>(slots_.size()) + static_cast<uint32_t>(resident_index_[l]);
    Occupancy& o = occ_[si];
    if (o.state != State::Empty && o.version == pool_.version(l)) continue;
    if (!ordered) {
      // After every reader of the old bytes: the last replay (or, before the
      // first, the capture, whose readers never ran).
      gpu.stream_wait(e.h2d(), last_launch ? last_launch : capture_event_);
      ordered = true;
    }
    fill_slot(si, l);
    o.state = State::Released;
    gpu.stream_wait(stream, slot(si).ready);  // the replay reads the new bytes
  }
}

void Ring::refresh_warm(std::vector<WarmSlot>& warm, StreamH stream, EventH last_launch) {
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  bool ordered = false;
  for (WarmSlot& w : warm) {
    const uint64_t version = pool_.version(w.layer);
    if (w.now_layer == w.layer && w.now_version == version) continue;
    // After every reader of what the slot holds: the last replay (before
    // the first, the capture's waits left no reader).
    if (!ordered && last_launch) gpu.stream_wait(e.h2d(), last_launch);
    ordered = true;
    w.now_layer = kNoLayer;  // a failed fill leaves the slot holding nothing
    const Source::Moved moved = pool_.source().fill(pool_.layer(w.layer), slot(w.slot));
    w.now_layer = w.layer;
    w.now_version = version;
    n_copies_ += moved.n_copies;
    bytes_ += moved.bytes;
    gpu.stream_wait(stream, slot(w.slot).ready);  // the replay reads the new bytes
  }
}

Graph::Graph(Ring& ring, void* exec, std::vector<uint32_t> layers, std::vector<uint32_t> resident,
             std::vector<WarmSlot> warm, std::vector<CapturePart*> parts, EventH done)
    : ring_(ring), exec_(exec), own_done_(!done),
      done_(done ? done : ring.engine().gpu().event_create(false)),
      layers_(std::move(layers)), resident_(std::move(resident)), warm_(std::move(warm)),
      parts_(std::move(parts)) {
  for (std::vector<uint32_t>* v : {&layers_, &resident_}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
}

Graph::~Graph() {
  Engine& e = ring_.engine();
  Backend& gpu = e.gpu();
  if (exec_) {  // an lwo_graph (the caller's was let go of by release_joined)
    try {
      DeviceScope scope(e);
      if (launched_) gpu.event_sync(done_);
    } catch (...) {
    }
    gpu.graph_destroy(exec_);
    for (CapturePart* p : parts_) p->released(launched_ ? done_ : nullptr);
    ring_.graph_released(launched_ ? done_ : nullptr);
  }
  if (own_done_) gpu.event_destroy(done_);
}

void Graph::launch(StreamH stream) {
  if (!stream)
    fail(LWO_ERR_INVALID_ARGUMENT, "launching a graph: stream is NULL: name the stream of the "
         "launch, a stream of the device");
  replay(stream, "launching a graph", [](Graph& g, StreamH s) {
    g.ring_.engine().gpu().graph_launch(g.exec_, s);
  });
}

void Graph::replay(StreamH stream, const char* what, void (*enqueue)(Graph&, StreamH)) {
  Engine& e = ring_.engine();
  e.check_not_capturing(what);
  {
    DeviceScope scope(e);
    if (e.gpu().capture_status(stream) != Backend::CaptureStatus::None)
      fail(LWO_ERR_CAPTURING, "%s: stream %p is capturing: a replay's host side runs once per "
           "launch, which a capture would not repeat; launch outside any capture", what, stream);
  }
  for (CapturePart* p : parts_) p->check_launch();
  if (Pool::Writer* w = ring_.pool().writer.load())
    for (uint32_t l : layers_) w->wait_layer(l);
  // Resident layers the host changed since the capture or the last launch go
  // up first, after the last replay, and the replay waits for them (a joined
  // graph's are held: none changed).
  if (!resident_.empty()) ring_.refresh_resident(resident_, stream, launched_ ? done_ : nullptr);
  // Slots a warm capture kept hold the layers the graph's hits read there.
  std::vector<uint64_t> end_versions;
  if (!warm_.empty()) {
    ring_.refresh_warm(warm_, stream, launched_ ? done_ : nullptr);
    // What this replay leaves in them: the layers' bytes as of now (a write
    // after this makes the next launch copy again).
    for (const WarmSlot& w : warm_)
      end_versions.push_back(w.end_layer == kNoLayer ? 0 : ring_.pool().version(w.end_layer));
  }
  // The caller's graph records done_ only where participants, or kept slots,
  // need it.
  const bool records_done = exec_ || !parts_.empty() || !warm_.empty();
  size_t armed = 0;
  auto disarm = [&] {
    while (armed) parts_[--armed]->disarm();
  };
  DeviceScope scope(e);
  Backend& gpu = e.gpu();
  try {
    for (; armed < parts_.size(); ++armed) parts_[armed]->arm();
    // Replays never overlap: they share the slots.
    if (launched_ && records_done) gpu.stream_wait(stream, done_);
    enqueue(*this, stream);
  } catch (...) {
    disarm();
    for (WarmSlot& w : warm_) w.now_layer = kNoLayer;  // the launch may have run in part
    throw;
  }
  launched_ = true;
  for (size_t i = 0; i < warm_.size(); ++i) {
    warm_[i].now_layer = warm_[i].end_layer;
    warm_[i].now_version = end_versions[i];
  }
  // The replay is enqueued (or, for the caller's graph, comes next): its
  // participants hear of it even if the event cannot be recorded (the error
  // then says the engine is broken).
  auto tell = [&] {
    for (CapturePart* p : parts_) p->launched(done_);
  };
  if (exec_) {
    try {
      gpu.event_record(done_, stream);
    } catch (...) {
      tell();
      throw;
    }
  }
  tell();
}

void Graph::release_joined(EventH after) noexcept {
  Engine& e = ring_.engine();
  if (!parts_.empty()) {
    // The last replay's host functions take the participants' replay state
    // (its gradient ends' serials): they must have run before it goes (also
    // after a launch the ring was not told of).
    try {
      DeviceScope scope(e);
      e.gpu().event_sync(done_);
    } catch (...) {
    }
  }
  for (CapturePart* p : parts_) p->released(after);
  parts_.clear();
}

}  // namespace lwo
