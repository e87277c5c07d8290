#include "ring.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

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

Ring::Ring(Pool& pool, uint32_t depth, uint32_t flags)
    : pool_(pool), serial_(next_serial()), slot_bytes_(pool.max_record_bytes()),
      timing_(flags & LWO_RING_TIMING) {
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  slots_.resize(depth);
  slot_of_layer_.assign(pool_.n_layers(), -1);
  try {
    for (Slot& s : slots_) {
      s.dev = static_cast<uint8_t*>(gpu.device_alloc(slot_bytes_));
      s.ready = gpu.event_create(false);
      s.free = gpu.event_create(false);
      s.shard_done = gpu.event_create(false);
    }
    if (pool_.staged()) {
      staging_.resize(2);
      for (Staging& st : staging_) {
        st.buf = PinnedArena(gpu, slot_bytes_, 0, "lwo_ring_create");
        st.ready = gpu.event_create(false);
        st.free = gpu.event_create(false);
      }
      fill_stream_ = gpu.stream_create();
    }
  } catch (const Error& err) {
    for (Staging& st : staging_) {
      gpu.event_destroy(st.ready);
      gpu.event_destroy(st.free);
    }
    staging_.clear();
    for (Slot& s : slots_) {
      gpu.device_free(s.dev);
      gpu.event_destroy(s.ready);
      gpu.event_destroy(s.free);
      gpu.event_destroy(s.shard_done);
    }
    if (err.status() == LWO_ERR_OUT_OF_MEMORY)
      fail(LWO_ERR_OUT_OF_MEMORY,
           "lwo_ring_create: depth %u x %llu-byte slots do not fit on device %d: %s", depth,
           static_cast<unsigned long long>(slot_bytes_), e.device(), err.what());
    throw;
  }
}

Ring::~Ring() {
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  try {
    DeviceScope scope(e);
    // Nothing may still write or read a slot when it is freed: copies end on
    // the transfer stream (ready), readers before their release (free).
    for (Slot& s : slots_) {
      if (s.state != State::Empty) gpu.event_sync(s.ready);
      if (s.ever_released) gpu.event_sync(s.free);
    }
  } catch (...) {
  }
  try {
    DeviceScope scope(e);
    for (Slot& s : slots_) {
      gpu.device_free(s.dev);
      gpu.event_destroy(s.ready);
      gpu.event_destroy(s.free);
      gpu.event_destroy(s.shard_done);
    }
    for (EventH ev : all_events_) gpu.event_destroy(ev);
    if (fill_stream_) {
      gpu.stream_sync(fill_stream_);
      gpu.stream_destroy(fill_stream_);
    }
    for (Staging& st : staging_) {
      if (st.used) gpu.event_sync(st.free);
      gpu.event_destroy(st.ready);
      gpu.event_destroy(st.free);
    }
    staging_.clear();
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

namespace {

// A host function on the fill stream: packs a layer's copy runs from their
// (not DMA-ready) sources into a pinned staging buffer, from several threads
// when the record is large.
struct FillJob {
  const std::vector<CopyRun>* runs;
  uint8_t* dst;
};

void copy_runs(const std::vector<CopyRun>& runs, uint8_t* dst, size_t part, size_t n_parts) {
  for (const CopyRun& r : runs) {
    uint64_t chunk = (r.bytes + n_parts - 1) / n_parts;
    uint64_t b = std::min<uint64_t>(r.bytes, chunk * part), e = std::min<uint64_t>(r.bytes, chunk * (part + 1));
    if (b < e) std::memcpy(dst + r.dst_offset + b, r.src + b, e - b);
  }
}

void run_fill(void* p) {
  std::unique_ptr<FillJob> job(static_cast<FillJob*>(p));
  uint64_t total = 0;
  for (const CopyRun& r : *job->runs) total += r.bytes;
  size_t n = static_cast<size_t>(std::min<uint64_t>(8, std::max<uint64_t>(1, total >> 24)));
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) {
    try {
      threads.emplace_back(copy_runs, std::cref(*job->runs), job->dst, i, n);
    } catch (...) {
      copy_runs(*job->runs, job->dst, i, n);
    }
  }
  copy_runs(*job->runs, job->dst, 0, n);
  for (auto& t : threads) t.join();
}

}  // namespace

void Ring::enqueue_staged_copy(const Pool::Layer& l, uint8_t* dst) {
  // Fill stream: wait until the staging buffer's last copy to the device is
  // done, pack the layer into it, mark it ready. Transfer stream: wait for
  // that, copy it to the slot, free the buffer. Two buffers alternate, so the
  // host packs one layer while the link carries the previous one.
  Backend& gpu = pool_.engine().gpu();
  StreamH h2d = pool_.engine().h2d();
  Staging& st = staging_[next_staging_++ % staging_.size()];
  if (st.used) gpu.stream_wait(fill_stream_, st.free);
  auto job = std::make_unique<FillJob>(FillJob{&l.runs, st.buf.data()});
  gpu.host_func(fill_stream_, run_fill, job.get());
  job.release();
  gpu.event_record(st.ready, fill_stream_);
  gpu.stream_wait(h2d, st.ready);
  uint64_t extent = 0;  // the bytes the runs fill, as the registered path copies
  for (const CopyRun& r : l.runs) extent = std::max(extent, r.dst_offset + r.bytes);
  if (extent) gpu.copy_h2d(dst, st.buf.data(), extent, h2d);
  gpu.event_record(st.free, h2d);
  st.used = true;
}

int32_t Ring::choose_slot(uint32_t layer, const char* call, int32_t* hit_slot) {
  pool_.layer(layer, call);  // range check
  if (const Checkpoint* ck = pool_.checkpoint()) ck->check_unchanged(call);
  int32_t si = slot_of_layer_[layer];
  uint64_t version = pool_.version(layer);
  if (si >= 0 && slots_[si].state == State::Released && slots_[si].version != version) {
    // The host bytes changed since the copy: the slot may be reused, never hit.
    slot_of_layer_[layer] = -1;
    si = -1;
  }
  if (si >= 0) {
    const Slot& s = slots_[si];
    if (s.state != State::Released)
      fail(LWO_ERR_LAYER_BUSY, "%s: layer %u is already %s in slot %d of ring depth %zu "
           "(ticket 0x%llx); release it first", call, layer, state_name(s.state), si,
           slots_.size(), static_cast<unsigned long long>(make_id(serial_, si, s.gen)));
    *hit_slot = si;
    return -1;
  }
  // Miss: an empty slot, else the least recently released one.
  int32_t victim = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state == State::Empty) {
      victim = static_cast<int32_t>(i);
      break;
    }
    if (s.state == State::Released &&
        (victim < 0 || s.last_release < slots_[victim].last_release))
      victim = static_cast<int32_t>(i);
  }
  if (victim < 0) {
    std::string held;
    for (size_t i = 0; i < slots_.size() && i < 16; ++i)
      held += strf("%sslot %zu: layer %u %s", i ? ", " : "", i, slots_[i].layer,
                   state_name(slots_[i].state));
    if (slots_.size() > 16) held += ", ...";
    fail(LWO_ERR_RING_FULL, "%s: layer %u: ring depth %zu has no free slot (%s)", call, layer,
         slots_.size(), held.c_str());
  }
  return victim;
}

lwo_ticket Ring::stage(uint32_t layer) {
  static const char* call = "lwo_ring_stage";
  std::lock_guard<std::mutex> lock(mu_);
  Engine& e = pool_.engine();
  // Sharded pools under the collective check: every rank says what this
  // stage will do (a copy, a hit, or an error of its own) before doing it.
  const bool check = pool_.comm() && e.checks_collectives();
  int32_t hit_slot = -1, victim = -1;
  try {
    victim = choose_slot(layer, call, &hit_slot);
  } catch (const Error&) {
    if (check) {
      try {
        e.check_collective(pool_.comm(), Engine::Step{call, layer, 0, false, true});
      } catch (const Error&) {
        // The other ranks learn of this rank's error; this rank reports its own.
      }
    }
    throw;
  }
  const Pool::Layer& l = pool_.layer(layer, call);
  if (check)
    e.check_collective(pool_.comm(),
                       Engine::Step{call, layer, l.layout.record_bytes, hit_slot >= 0, false});
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  if (timing_) harvest(false);
  if (hit_slot >= 0) {
    // Hit: the bytes are still in the slot.
    Slot& s = slots_[hit_slot];
    s.state = State::Staged;
    s.gen = (s.gen + 1) & kGenMask;
    s.merge_free = true;
    ++n_stages_;
    ++n_hits_;
    return lwo_ticket{make_id(serial_, static_cast<uint32_t>(hit_slot), s.gen)};
  }
  Slot& s = slots_[victim];
  StreamH h2d = e.h2d();
  // Every reader of the previous occupant released on some stream before the
  // free event; the copy waits for it.
  if (s.ever_released) gpu.stream_wait(h2d, s.free);
  // A sharded slot was last written by an all-gather on the communication
  // stream, which a release without an acquire does not wait for.
  if (s.ever_gathered) gpu.stream_wait(h2d, s.ready);

  EventH t0 = nullptr, t1 = nullptr;
  if (timing_) {
    t0 = timing_event();
    t1 = timing_event();
    gpu.event_record(t0, h2d);
  }
  uint64_t moved = 0;
  try {
    if (pool_.staged()) {
      enqueue_staged_copy(l, s.dev);
      for (const CopyRun& r : l.runs) moved += r.bytes;
    } else {
      for (const CopyRun& r : l.runs) {
        gpu.copy_h2d(s.dev + r.dst_offset, r.src, r.bytes, h2d);
        moved += r.bytes;
      }
    }
    if (pool_.comm()) {
      // The local shard went up this rank's link; the other ranks' shards
      // come over the GPUs' links: all-gather the record into the slot on
      // the communication stream, which then holds the slot's ready event.
      StreamH cs = engine().comm();
      gpu.event_record(s.shard_done, h2d);
      gpu.stream_wait(cs, s.shard_done);
      gpu.all_gather(s.dev + l.shard_bytes * static_cast<uint64_t>(pool_.rank()), s.dev,
                     l.shard_bytes, pool_.comm(), cs);
      gpu.event_record(s.ready, cs);
      s.ever_gathered = true;
    } else {
      gpu.event_record(s.ready, h2d);
    }
  } catch (...) {
    // The slot may now hold part of this layer: it no longer holds the old
    // one, so it must never be a hit for it.
    if (s.state == State::Released && slot_of_layer_[s.layer] == victim)
      slot_of_layer_[s.layer] = -1;
    s.state = State::Empty;
    throw;
  }
  if (timing_) {
    gpu.event_record(t1, h2d);
    pending_.push_back({Timed::Copy, t0, t1});
  }
  // Only now, with every enqueue done, change the table.
  if (s.state == State::Released && slot_of_layer_[s.layer] == victim)
    slot_of_layer_[s.layer] = -1;
  s.state = State::Staged;
  s.layer = layer;
  s.version = pool_.version(layer);
  s.gen = (s.gen + 1) & kGenMask;
  s.merge_free = false;
  s.tensor_ptrs.resize(l.layout.tensors.size());
  for (size_t i = 0; i < l.layout.tensors.size(); ++i)
    s.tensor_ptrs[i] = s.dev + l.layout.tensors[i].offset;
  s.view.layer = layer;
  s.view.n_tensors = static_cast<uint32_t>(s.tensor_ptrs.size());
  s.view.base = s.dev;
  s.view.record_bytes = l.layout.record_bytes;
  s.view.tensors = s.tensor_ptrs.data();
  slot_of_layer_[layer] = victim;
  ++n_stages_;
  n_copies_ += pool_.staged() ? (l.runs.empty() ? 0 : 1) : l.runs.size();
  bytes_ += moved;
  return lwo_ticket{make_id(serial_, static_cast<uint32_t>(victim), s.gen)};
}

Ring::Slot& Ring::check_ticket(lwo_ticket t, const char* call, uint32_t* slot_index) {
  uint64_t serial = t.id >> (kSlotBits + kGenBits);
  uint32_t slot = static_cast<uint32_t>((t.id >> kGenBits) & ((1u << kSlotBits) - 1));
  uint64_t gen = t.id & kGenMask;
  if (t.id == 0)
    fail(LWO_ERR_FOREIGN_TICKET, "%s: ticket 0 is not a ticket (was the stage call checked?)",
         call);
  if (serial != serial_ || slot >= slots_.size())
    fail(LWO_ERR_FOREIGN_TICKET, "%s: ticket 0x%llx was not issued by this ring (depth %zu)",
         call, static_cast<unsigned long long>(t.id), slots_.size());
  Slot& s = slots_[slot];
  if (gen != s.gen)
    fail(LWO_ERR_STALE_TICKET,
         "%s: ticket 0x%llx is stale: slot %u has since been reused (now layer %u, %s)", call,
         static_cast<unsigned long long>(t.id), slot, s.layer, state_name(s.state));
  if (s.state == State::Released || s.state == State::Empty)
    fail(LWO_ERR_STALE_TICKET, "%s: ticket 0x%llx (slot %u, layer %u) was already released",
         call, static_cast<unsigned long long>(t.id), slot, s.layer);
  *slot_index = slot;
  return s;
}

void Ring::acquire(lwo_ticket t, StreamH stream, lwo_layer_view* view) {
  static const char* call = "lwo_ring_acquire";
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = 0;
  Slot& s = check_ticket(t, call, &si);
  if (s.state == State::Acquired)
    fail(LWO_ERR_TICKET_STATE,
         "%s: ticket 0x%llx (slot %u, layer %u) is already acquired; a ticket is acquired once",
         call, static_cast<unsigned long long>(t.id), si, s.layer);
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  EventH t0 = nullptr, t1 = nullptr;
  if (timing_) {
    t0 = timing_event();
    t1 = timing_event();
    gpu.event_record(t0, stream);
  }
  gpu.stream_wait(stream, s.ready);
  if (s.merge_free) gpu.stream_wait(stream, s.free);
  if (timing_) {
    gpu.event_record(t1, stream);
    pending_.push_back({Timed::Wait, t0, t1});
  }
  s.merge_free = false;
  s.state = State::Acquired;
  if (view) *view = s.view;
}

void* Ring::tensor(lwo_ticket t, const char* name) {
  static const char* call = "lwo_ring_tensor";
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = 0;
  Slot& s = check_ticket(t, call, &si);
  uint32_t ti = pool_.tensor_index(s.layer, name, call);
  return s.tensor_ptrs[ti];
}

void Ring::release(lwo_ticket t, StreamH stream) {
  static const char* call = "lwo_ring_release";
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t si = 0;
  Slot& s = check_ticket(t, call, &si);
  Engine& e = pool_.engine();
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  // A hit that was never acquired has not joined the previous readers yet.
  if (s.merge_free) gpu.stream_wait(stream, s.free);
  gpu.event_record(s.free, stream);
  s.merge_free = false;
  s.ever_released = true;
  s.state = State::Released;
  s.last_release = ++clock_;
}

bool Ring::layer_busy(uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer >= slot_of_layer_.size()) return false;
  int32_t si = slot_of_layer_[layer];
  return si >= 0 && slots_[si].state != State::Released;
}

void Ring::check_destroyable(const char* call) {
  std::lock_guard<std::mutex> lock(mu_);
  int ns = n_schedules.load();
  if (ns > 0) fail(LWO_ERR_BUSY, "%s: %d schedule%s of the ring still exist", call, ns,
                   ns == 1 ? "" : "s");
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].state == State::Acquired)
      fail(LWO_ERR_BUSY, "%s: slot %zu is still acquired by layer %u (ticket 0x%llx); release it first",
           call, i, slots_[i].layer,
           static_cast<unsigned long long>(make_id(serial_, static_cast<uint32_t>(i), slots_[i].gen)));
}

void Ring::info(lwo_ring_info* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->depth = static_cast<uint32_t>(slots_.size());
  uint32_t n_free = 0;
  for (const Slot& s : slots_)
    n_free += (s.state == State::Empty || s.state == State::Released);
  out->n_free = n_free;
  out->slot_bytes = slot_bytes_;
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
