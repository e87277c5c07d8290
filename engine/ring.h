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
#include "slots.h"

namespace lwo {

class Ring {
 public:
  Ring(Pool& pool, uint32_t depth, uint32_t flags);
  ~Ring();  // waits for copies and releases; caller checks check_destroyable() first
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  Pool& pool() { return pool_; }
  Engine& engine() { return pool_.engine(); }
  uint32_t depth() const { return static_cast<uint32_t>(slots_.size()); }
  uint64_t slot_bytes() const { return slots_.bytes(); }

  lwo_ticket stage(uint32_t layer);
  // Fills the whole of *view (its size is sizeof(lwo_layer_view)).
  void acquire(lwo_ticket t, StreamH stream, lwo_layer_view* view);
  void release(lwo_ticket t, StreamH stream);
  uint32_t release_all(StreamH stream);
  void* tensor(lwo_ticket t, const char* name);
  bool landed(lwo_ticket t);
  lwo_ticket_state_t ticket_state(lwo_ticket t);
  void info(lwo_ring_info* out);
  void stats(lwo_ring_stats* out);
  void reset_stats();

  // Non-throwing state query for the scheduler: true if `layer` is staged or
  // held under a live ticket.
  bool layer_busy(uint32_t layer);
  // Throws LWO_ERR_BUSY (naming the slots) if a ticket is acquired and not
  // released, or a schedule exists.
  void check_destroyable();

  std::atomic<int> n_schedules{0};  // live schedules of the ring (they count themselves)

 private:
  enum class State : uint8_t { Empty, Staged, Acquired, Released };
  // What the ring's table says of one slot (the slot itself is slots_[i]).
  struct Occupancy {
    State state = State::Empty;
    uint32_t layer = 0;
    uint64_t version = 0;          // the pool's version of the layer when copied
    uint64_t gen = 0;
    bool merge_free = false;       // hit: next acquire/release must wait slot.free
    bool ready_elsewhere = false;  // the last fill recorded ready off the
                                   // transfer stream: the next fill waits for it
    std::vector<void*> tensor_ptrs;
  };
  struct Timed {
    enum Kind { Copy, Wait } kind;
    EventH a, b;
  };

  // The slot that will hold `layer`: returns a victim to fill, or -1 with
  // *hit_slot set when the layer is still in a released slot. Throws
  // (LWO_ERR_OUT_OF_RANGE, FILE_CHANGED, LAYER_BUSY, RING_FULL, in that
  // order) with nothing changed.
  int32_t choose_slot(uint32_t layer, int32_t* hit_slot);
  // Decodes a ticket of this ring (LWO_ERR_FOREIGN_TICKET otherwise).
  uint32_t slot_of(lwo_ticket t);
  // A live ticket's slot (LWO_ERR_STALE_TICKET once it has ended).
  uint32_t check_ticket(lwo_ticket t);
  void release_locked(uint32_t si, StreamH stream);
  void fill_view(uint32_t si, lwo_layer_view* view);
  const char* state_name(State s) const;
  uint64_t ticket_id(uint32_t si) const;
  EventH timing_event();
  void harvest(bool block);

  Pool& pool_;
  uint64_t serial_;
  bool timing_;
  std::mutex mu_;
  SlotSet slots_;
  std::vector<Occupancy> occ_;
  std::vector<int32_t> slot_of_layer_;  // -1 if not in a slot
  // Statistics.
  uint64_t n_stages_ = 0, n_hits_ = 0, n_copies_ = 0, bytes_ = 0;
  double copy_ms_ = 0, wait_ms_ = 0;
  std::deque<Timed> pending_;
  std::vector<EventH> spare_events_;
  std::vector<EventH> all_events_;
};

// Ticket ids: ring serial (16 bits) | slot (12 bits) | generation (36 bits).
constexpr uint32_t kMaxDepth = 4096;

}  // namespace lwo
