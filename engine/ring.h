// The device slot ring: D slots, each sized to the pool's largest record, with
// per-slot ready and free events and a host-side table slot -> (layer, state).
//
// Ordering, all of it in CUDA events (the host never waits in steady state):
//   stage (copy):  transfer stream waits slot.free, copies, records slot.ready
//   acquire:       consumer stream waits slot.ready (and, after a hit, the
//                  previous occupant's slot.free, so the next release covers
//                  every earlier reader)
//   release:       consumer stream records slot.free
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "pool.h"

namespace lwo {

class Ring {
 public:
  Ring(Pool& pool, uint32_t depth, uint32_t flags);
  ~Ring();  // waits for copies and releases; caller checks busy() first
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  Pool& pool() { return pool_; }
  Engine& engine() { return pool_.engine(); }
  uint32_t depth() const { return static_cast<uint32_t>(slots_.size()); }
  uint64_t slot_bytes() const { return slot_bytes_; }

  lwo_ticket stage(uint32_t layer);
  void acquire(lwo_ticket t, StreamH stream, lwo_layer_view* view);
  void release(lwo_ticket t, StreamH stream);
  void* tensor(lwo_ticket t, const char* name);
  void info(lwo_ring_info* out);
  void stats(lwo_ring_stats* out);
  void reset_stats();

  // Non-throwing state query for the scheduler: true if `layer` is staged or
  // held under a live ticket.
  bool layer_busy(uint32_t layer);
  // Throws LWO_ERR_BUSY (naming the slots) if a ticket is acquired and not
  // released, or a schedule exists.
  void check_destroyable(const char* call);

  std::atomic<int> n_schedules{0};

 private:
  enum class State : uint8_t { Empty, Staged, Acquired, Released };
  struct Slot {
    State state = State::Empty;
    uint32_t layer = 0;
    uint64_t version = 0;        // the pool's version of the layer when copied
    uint64_t gen = 0;
    uint64_t last_release = 0;   // LRU clock
    bool ever_released = false;  // slot.free has been recorded at least once
    bool merge_free = false;     // hit: next acquire/release must wait slot.free
    uint8_t* dev = nullptr;
    EventH ready = nullptr;
    EventH free = nullptr;
    EventH shard_done = nullptr;  // sharded pools: the local shard has landed
    bool ever_gathered = false;   // sharded pools: ready follows an all-gather
    std::vector<void*> tensor_ptrs;
    lwo_layer_view view{};
  };
  struct Timed {
    enum Kind { Copy, Wait } kind;
    EventH a, b;
  };

  // The slot that will hold `layer`: returns a victim to copy into, or -1
  // with *hit_slot set when the layer is still in a released slot. Throws
  // (LWO_ERR_OUT_OF_RANGE, LAYER_BUSY, RING_FULL, FILE_CHANGED) with nothing
  // changed that matters.
  int32_t choose_slot(uint32_t layer, const char* call, int32_t* hit_slot);
  Slot& check_ticket(lwo_ticket t, const char* call, uint32_t* slot_index);
  const char* state_name(State s) const;
  EventH timing_event();
  void harvest(bool block);

  Pool& pool_;
  uint64_t serial_;
  uint64_t slot_bytes_;
  bool timing_;
  std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<int32_t> slot_of_layer_;  // -1 if not in a slot
  uint64_t clock_ = 0;
  // Statistics.
  uint64_t n_stages_ = 0, n_hits_ = 0, n_copies_ = 0, bytes_ = 0;
  double copy_ms_ = 0, wait_ms_ = 0;
  std::deque<Timed> pending_;
  // Staged pools (sources not DMA-ready): two pinned staging buffers of one
  // slot each, filled by host functions on their own stream, in turn.
  struct Staging {
    PinnedArena buf;
    EventH ready = nullptr, free = nullptr;
    bool used = false;
  };
  std::vector<Staging> staging_;
  StreamH fill_stream_ = nullptr;
  size_t next_staging_ = 0;
  void enqueue_staged_copy(const Pool::Layer& l, uint8_t* dst);
  std::vector<EventH> spare_events_;
  std::vector<EventH> all_events_;
};

// Ticket ids: ring serial (16 bits) | slot (12 bits) | generation (36 bits).
constexpr uint32_t kMaxDepth = 4096;

}  // namespace lwo
