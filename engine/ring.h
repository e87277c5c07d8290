// The device slot ring: D slots, each sized to the pool's largest record, with
// per-slot ready and free events and a host-side table slot -> (layer, state).
//
// Ordering, all of it in CUDA events (the host never waits in steady state):
//   stage (copy):  transfer stream waits slot.free, copies, records slot.ready
//   acquire:       consumer stream waits slot.ready (and, after a hit, the
//                  previous occupant's slot.free, so the next release covers
//                  every earlier reader)
//   release:       consumer stream records slot.free
//
// Checking mode (Engine::checking, at creation): release also makes the
// consumer stream wait slot.ready and fills the record with kCheckingByte
// before it records slot.free, and the slot is then empty (never a hit), so
// the next stage fills it again after the fill.
//
// Resident layers: the ring also holds one slot of its own per
// resident layer, sized to its record, filled once at creation through the
// pool's source and never a victim. Staging a resident layer is a hit; after
// lwo_pool_layer_changed (or lwo_pool_write) the next stage fills the same
// slot again, ordered after its free event like any fill, so every reader of
// the old bytes is done first. Their tickets are tickets of slots depth..
// depth + n_resident - 1, with the same states, acquire and release.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "lwo.h"
#include "pool.h"
#include "slots.h"

namespace lwo {

// A ring slot that a warm capture (LWO_RING_CAPTURE_WARM) kept and hit: the
// layer its replays read there before anything of theirs fills it, the layer
// each replay leaves there, and what the slot holds now (the layer and the
// pool's version of it when copied).
constexpr uint32_t kNoLayer = UINT32_MAX;  // a WarmSlot's slot that holds nothing known
struct WarmSlot {
  uint32_t slot;
  uint32_t layer;
  uint32_t end_layer;
  uint32_t now_layer;
  uint64_t now_version;
};

class Ring {
 public:
  // `resident`: layer ids kept on the device (checked: LWO_ERR_OUT_OF_RANGE,
  // LWO_ERR_INVALID_ARGUMENT for a repeated id or depth + n above kMaxDepth,
  // LWO_ERR_UNSUPPORTED for a sharded pool, LWO_ERR_OVER_BUDGET,
  // LWO_ERR_OUT_OF_MEMORY).
  Ring(Pool& pool, uint32_t depth, uint32_t flags, const std::vector<uint32_t>& resident = {});
  ~Ring();  // waits for copies and releases; caller checks check_destroyable() first
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  Pool& pool() { return pool_; }
  Engine& engine() { return pool_.engine(); }
  uint32_t depth() const { return static_cast<uint32_t>(slots_.size()); }
  uint64_t slot_bytes() const { return slots_.bytes(); }
  uint32_t n_resident() const { return static_cast<uint32_t>(resident_.size()); }
  bool is_resident(uint32_t layer) const {
    return layer < resident_index_.size() && resident_index_[layer] >= 0;
  }

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
  // How many times the table was emptied wholesale (forget_slots: a capture
  // begun, discarded or its graph destroyed). A ticket issued before the
  // latest has ended: a schedule drops its tickets of an earlier count.
  uint64_t table_epoch() const { return table_epoch_.load(); }

  // CUDA graph capture (lwo.h, lwo_ring_capture_begin): capture_begin waits
  // until nothing of the ring runs, takes its slots as empty and begins a
  // capture on `stream` with the transfer stream joined; capture_end joins it
  // back and returns the instantiated graph, to which the ring then belongs
  // (stage, acquire, release and destruction are LWO_ERR_BUSY) until the
  // graph gives it back (graph_released: its launches are done, the last one
  // recorded `last_launch` (null: none); the slots are empty again). The
  // layers staged during the capture are the graph's.
  //
  // Resident layers in a capture: capture_begin first uploads those changed
  // since their last upload and waits for them; a captured stage of one is a
  // hit whose acquire waits on nothing from before the capture, so the graph
  // copies nothing into resident slots. Graph::launch calls refresh_resident,
  // which uploads a resident layer the graph reads and the host changed since
  // (lwo_pool_layer_changed, lwo_pool_write) before the replay, on `stream`.
  // In checking mode the slots are taken as empty instead: each resident
  // layer's first stage in the capture is a copy, as its releases poison it.
  void capture_begin(StreamH stream);
  std::unique_ptr<class Graph> capture_end(StreamH stream);
  void graph_released(EventH last_launch);
  void refresh_resident(const std::vector<uint32_t>& layers, StreamH stream, EventH last_launch);
  // A warm capture's slots before a launch on `stream`: each one whose hit
  // needs a layer the slot does not hold now (or holds at an older version
  // of the pool's bytes) is filled again, after the last replay (before the
  // first, after nothing: the capture's waits left no reader), and `stream`
  // waits for it. Updates each entry's now_ fields as it fills.
  void refresh_warm(std::vector<WarmSlot>& warm, StreamH stream, EventH last_launch);
  // Joining a capture the caller began on `stream` (lwo_ring_capture_join):
  // as capture_begin, but the capture is the caller's (LWO_ERR_CAPTURING if
  // `stream` is not capturing); capture_leave joins the transfer stream back
  // and binds the ring to the caller's graph until capture_release, whose
  // `stream` orders the ring's later work after the graph's replays. While
  // joined or bound, the pool's resident layers of the ring are held
  // (Pool::hold). No gradient set takes part (LWO_ERR_UNSUPPORTED).
  //
  // Gradient sets take part in a joined capture as in the ring's own
  // (CapturePart): the leave takes them, joins their streams back and ends
  // the ring's part of the capture with an event record node (the graph's
  // `done`, recorded at each replay). capture_replay, before each of the
  // caller's launches, does the host side of one replay that Graph::launch
  // does before an lwo_graph's (Graph::replay); capture_release waits for the
  // last replay's host work where gradient sets took part (their replayed
  // ends refer to the set) and gives them back.
  void capture_join(StreamH stream);
  void capture_leave(StreamH stream);
  void capture_replay(StreamH stream);
  void capture_release(StreamH stream);
  // Throws LWO_ERR_CAPTURING, naming `what`, while another ring of the engine
  // captures (the transfer stream is part of that capture).
  void check_not_captured_elsewhere(const char* what) const;

 private:
  enum class State : uint8_t { Empty, Staged, Acquired, Released };
  // What the ring's table says of one slot (the slot itself is slots_[i]).
  struct Occupancy {
    State state = State::Empty;
    uint32_t layer = 0;
    uint64_t version = 0;          // the pool's version of the layer when copied
    uint64_t id = 0;               // its ticket's id (0: none issued yet)
    bool merge_free = false;       // hit: next acquire/release must wait slot.free
    bool ready_elsewhere = false;  // the last fill recorded ready off the
                                   // transfer stream: the next fill waits for it
    bool ready_outside = false;    // a resident slot in a capture, or a warm
                                   // capture's kept slot: filled before it (the
                                   // host waited), so acquires wait on nothing
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
  // Slot si of the table: a ring slot below depth, a resident slot above.
  DeviceSlot& slot(uint32_t si) {
    return si < slots_.size() ? slots_[si] : resident_[si - slots_.size()];
  }
  void slot_freed(uint32_t si) {
    if (si < slots_.size()) slots_.freed(si); else resident_.freed(si - slots_.size());
  }
  void slot_emptied(uint32_t si) {
    if (si < slots_.size()) slots_.emptied(si); else resident_.emptied(si - slots_.size());
  }
  // Enqueues the fill of slot si with `layer` (ordered after the slot's
  // readers) and updates the table; on failure the slot holds nothing.
  void fill_slot(uint32_t si, uint32_t layer);
  uint64_t ticket_id(uint32_t si) const;
  // The id of slot si's next ticket: this ring's serial, the slot and the
  // ring's sequence number; after 65535 tickets the ring draws a new serial.
  uint64_t new_ticket_id(uint32_t si);
  EventH timing_event();
  void harvest(bool block);
  // Graph capture: refuses calls on a ring a graph holds (LWO_ERR_BUSY) and
  // stages of a ring other than the engine's capturing one (LWO_ERR_CAPTURING).
  void check_not_bound(const char* what) const;
  // Every slot empty, never freed, nothing in the table (no device work of
  // the ring may still run or be waited for).
  void forget_slots();
  // The ring slots as a capture takes them (after prepare_capture's waits):
  // empty (forget_slots), or for a warm ring outside checking mode, each
  // released slot that holds its layer at the pool's current version kept,
  // never freed, ready from before the capture (ready_outside).
  void slots_into_capture();
  // At a warm capture's end (in it): each kept slot the capture hit and then
  // filled with another layer gets its layer back, after its last reader, so
  // that every replay leaves the slots as its start reads them (as an eager
  // pass prefetches the next one's first layers); the next launch then
  // copies only what the host changed meanwhile.
  void restore_warm();
  // The kept slots the capture hit, each with what the capture leaves in it.
  std::vector<WarmSlot> warm_of_capture() const;
  // Checks and waits shared by capture_begin and capture_join (under mu_):
  // what cannot be captured, live tickets; then uploads the resident layers
  // that changed and waits until nothing of the ring runs.
  void prepare_capture(StreamH stream, const char* what, bool join);
  // The resident slots as a capture takes them (after the waits) and as it
  // leaves them: never freed, their readiness from before it; in checking
  // mode empty. `live_ends`: tickets still live end (a discarded capture).
  void resident_into_capture();
  void resident_out_of_capture();
  // Holds (+1) or lets go of (-1) the pool's resident layers of the ring.
  void hold_resident(int delta);
  // The ring is given back (graph_released, capture_release): the transfer
  // stream waits for `after` and the slots are empty again.
  void give_back(EventH after, EventH last_launch);
  // For messages about live tickets: how a schedule of the ring lets go of
  // its own ("" without schedules).
  const char* schedules_hint() const;

  Pool& pool_;
  uint64_t serial_;                    // the serial of the ring's new tickets
  uint32_t seq_ = 0;                   // the last sequence number under serial_
  std::vector<uint64_t> old_serials_;  // the ring's earlier serials, ascending
  bool timing_;
  bool checking_;  // the engine's checking mode at creation: releases poison
  std::mutex mu_;
  std::vector<int32_t> resident_index_;  // per layer: index into resident_, or -1
  Charge slot_charge_;  // before slots_: charged before they are allocated
  SlotSet slots_;
  Charge resident_charge_;
  SlotSet resident_;  // one per resident layer, its record's size
  std::vector<Occupancy> occ_;
  std::vector<int32_t> slot_of_layer_;  // -1 if not in a slot
  // Statistics.
  uint64_t n_stages_ = 0, n_hits_ = 0, n_copies_ = 0, bytes_ = 0;
  uint64_t n_resident_hits_ = 0, n_resident_uploads_ = 0, resident_bytes_ = 0;
  double copy_ms_ = 0, wait_ms_ = 0;
  std::deque<Timed> pending_;
  std::vector<EventH> spare_events_;
  std::vector<EventH> all_events_;
  // Graph capture.
  StreamH capture_stream_ = nullptr;  // the capture's stream while capturing
  bool bound_ = false;                // a graph holds the ring
  bool joined_ = false;               // the capture or graph is the caller's (capture_join)
  std::vector<uint32_t> captured_resident_;  // resident layers hit in the capture
  bool warm_ = false;                        // LWO_RING_CAPTURE_WARM
  std::vector<WarmSlot> captured_warm_;      // kept slots hit in the capture
  EventH capture_event_ = nullptr;    // the transfer stream's join and leave
  std::vector<uint32_t> captured_layers_;
  // The caller's graph (from capture_leave until capture_release), and the
  // event its record node records at each replay (made once per ring: a
  // graph the caller keeps past the release may still refer to it).
  std::unique_ptr<class Graph> joined_graph_;
  EventH joined_done_ = nullptr;
  std::atomic<uint64_t> table_epoch_{0};
};

// A CUDA graph of one ring's pass: an instantiated one that lwo launches
// (lwo_graph, lwo_ring_capture_end), whose destructor waits for the last
// launch, destroys the graph and gives the ring back; or the caller's graph
// of a joined capture (exec null, the ring's from capture_leave until
// capture_release), which the caller launches.
class Graph {
 public:
  // `parts`: what else the capture holds (gradient sets), told of each
  // launch and of the graph's end.
  // `resident`: the resident layers the graph reads without copying them,
  // uploaded before a launch if they changed (Ring::refresh_resident).
  // `done`: null for an lwo_graph (the graph makes its own, recorded after
  // each launch); the caller's graph's event, recorded by a node of it.
  // `warm`: the kept slots a warm capture read (Ring::refresh_warm).
  Graph(Ring& ring, void* exec, std::vector<uint32_t> layers, std::vector<uint32_t> resident,
        std::vector<WarmSlot> warm, std::vector<CapturePart*> parts, EventH done = nullptr);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  // One replay of an lwo_graph on `stream`: its host side (replay), then the
  // launch and its done event.
  void launch(StreamH stream);
  // The host side of one replay on `stream`, the same for both kinds, before
  // the launch: the refusals (a capture of the engine under way, `stream`
  // capturing, a participant's check), the pool writer's waits for every
  // layer the graph copies, the upload of changed resident layers, the order
  // after the last replay (its done event), the participants armed; then
  // `enqueue` (the launch: for the caller's graph nothing, as the caller
  // launches next), disarming them if it throws; then the participants are
  // told of the replay (launched). `what` names the call in messages.
  void replay(StreamH stream, const char* what, void (*enqueue)(Graph&, StreamH));
  // The caller's graph is let go of (Ring::capture_release, `after` recorded
  // where every launch is ordered before it): waits for the last replay's
  // host work where participants took part, and gives them back.
  void release_joined(EventH after) noexcept;
  bool has_parts() const { return !parts_.empty(); }
  Ring& ring() { return ring_; }
  void check_destroyable() {}

 private:
  Ring& ring_;
  void* exec_;
  bool own_done_;
  EventH done_;
  bool launched_ = false;
  std::vector<uint32_t> layers_;
  std::vector<uint32_t> resident_;
  std::vector<WarmSlot> warm_;
  std::vector<CapturePart*> parts_;
};

// Ticket ids: ring serial (36 bits) | slot (12 bits) | sequence (16 bits). A
// serial is drawn from a process-wide counter that never wraps, at creation
// and after every 65535 tickets of a ring: no ticket repeats in a process.
// The 12 slot bits number LWO_MAX_RING_DEPTH slots.
constexpr uint32_t kMaxDepth = LWO_MAX_RING_DEPTH;

}  // namespace lwo
