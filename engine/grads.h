// Weight gradients to host memory: device staging slots the caller's backward
// writes into, device-to-host copies on the engine's gradient stream, and
// host buffers (one per tensor of every trainable layer, in the tensor's
// dtype or f32) that accumulate across micro-batches until zeroed. The host
// may read them only after wait(), the fence. The set's sink (engine/sink.h),
// chosen once when the set is made, lays out each layer's gradient (dtypes,
// offsets, the part this rank keeps) and sums the slot before its copy; the
// set itself is the same for every pool.
//
// Ordering, per staging slot (like the weight ring, mirrored):
//   begin:  caller stream waits slot.free (the slot's previous copy to host)
//   end:    caller stream records slot.ready; the sink makes the gradient
//           stream wait for it (and for the sum over the ranks); the stream
//           copies the sink's part of the slot to host, records slot.free,
//           and where the bytes need converting or adding hands the
//           accumulation to the set's worker thread by a host function in
//           stream order: the worker adds while the stream copies the next
//           layer. A host function before each copy into a staging buffer
//           waits until the worker is done with that buffer's previous
//           contents; wait() waits for the stream and then for the worker.
// Checking mode (Engine::checking, at creation): each end fills its staging
// slot with kCheckingByte on the gradient stream after the copy down, before
// slot.free; creation and zero() fill the host gradients of the layers they
// leave waiting for a gradient (the stale ones), which the next gradient
// assigns or wait() zeroes. Accumulating ends leave the running sum alone.
// Where the wire dtype is the host buffer's (the default, and LWO_GRADS_F32)
// and the layer is freshly zeroed, the copy lands straight in the host
// buffer: no host work at all.
//
// CUDA graphs (a CapturePart): begin and end are captured when a ring of the
// set's pool captures. At its first call in the capture the set joins it:
// nothing of the set may still run (the gradient stream is synchronised,
// the worker drained), its slots are taken as never freed, and its host
// state is saved. Each captured end is one ReplayEnd, the persistent
// argument of its host functions (a staging buffer's wait, and the landing:
// the job posted to the worker, or for a copy straight into the host buffer
// the landing marked); the gradient stream joins the capture through the
// sink's wait, and back before it ends. The capture runs nothing, so the
// saved host state comes back when it ends; the graph then holds the set
// (begin, end: LWO_ERR_BUSY) until it is destroyed. Each launch checks that
// every layer the graph ends is as fresh as at the capture (its first end
// assigns, or adds), waits for the optimizer's reads of them, then does the
// host side of each end in the capture's order: a new serial (queued per
// layer, where the replay's landing takes it), the layer's state and the
// counters. wait() first waits for the last launch (its host functions have
// then run); a replayed end's landing is the worker's or the host function's
// record of its serial, not an event.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arena.h"
#include "pool.h"
#include "sink.h"
#include "slots.h"

namespace lwo {

class Grads final : public CapturePart {
 public:
  using Mode = GradsMode;  // the dtypes of the wire and the host buffers
  // `replica`: a communicator the sharded pool's gradient parts are summed
  // over too (Sink::make), or null.
  Grads(Pool& pool, const uint8_t* trainable, uint32_t depth, Mode mode, uint32_t n_threads,
        void* replica = nullptr);
  ~Grads() override;  // caller checks check_destroyable() first
  Grads(const Grads&) = delete;
  Grads& operator=(const Grads&) = delete;

  // Fills the whole of *view (its size is sizeof(lwo_layer_view)).
  void begin(uint32_t layer, StreamH stream, lwo_layer_view* view);
  void end(uint32_t layer, StreamH stream);
  void wait();
  void zero();
  // Non-blocking: every gradient ended so far has landed and been added.
  bool done();
  // This rank's part of a tensor's gradient (the whole tensor unless the pool
  // is sharded): elements [*first, *first + *n) of dtype *dtype at the
  // returned address.
  void* tensor(uint32_t layer, const char* name, lwo_dtype_t* dtype, uint64_t* first,
               uint64_t* n);
  // The host gradients of a trainable layer, one entry per tensor, each the
  // whole tensor (an optimizer's view). Throws LWO_ERR_INVALID_ARGUMENT for a
  // frozen layer, LWO_ERR_INTERNAL where the set keeps only part of a tensor.
  struct HostTensor {
    const void* data;
    lwo_dtype_t dtype;
    uint64_t n;
  };
  std::vector<HostTensor> whole_layer(uint32_t layer);
  void stats(lwo_grads_stats* out);
  void check_destroyable();
  Pool& pool() { return pool_; }

  // ---- The hook of an optimizer (engine/optimizer.h) ----
  // A reader of the host gradients outside the fence: begin() waits (before
  // anything else) until it has done reading the layer, so no new gradient
  // lands under it, and wait() until it has done reading a layer it is about
  // to zero lazily. wait_all is for callers that need every read done.
  struct Reader {
    virtual ~Reader() = default;
    virtual void wait_reading(uint32_t layer) = 0;
    virtual void wait_all() = 0;
  };
  // LWO_ERR_BUSY if a reader is attached already; nullptr detaches.
  void attach(Reader* reader);
  bool trainable(uint32_t layer) const { return layer < layers_.size() && layers_[layer].trainable; }
  // The serial of the layer's last end (0: none yet; serials grow over the
  // set's ends), and whether the layer was zeroed with no gradient since.
  uint64_t last_end(uint32_t layer, bool* stale);
  // Blocks until the layer's end `serial` (and so every earlier one) has
  // landed in host memory and been added: the layer's buffers hold it. Any
  // thread; needs no lock the caller of begin/end/zero holds while waiting.
  void wait_landed(uint32_t layer, uint64_t serial);
  // Non-blocking: whether wait_landed(layer, serial) would return at once.
  bool landed(uint32_t layer, uint64_t serial);

  // ---- CapturePart (engine.h): the set in a ring's CUDA graph ----
  std::string live() override;
  void join_back(StreamH stream) override;
  void ended(bool kept, StreamH stream) noexcept override;
  void check_launch() override;
  void arm() override;
  void disarm() noexcept override;
  void launched(EventH done) noexcept override;
  void released(EventH last) noexcept override;

 private:
  struct Layer {
    bool trainable = false;
    bool fresh = true;      // the next gradient assigns instead of adding
    bool stale = false;     // zeroed lazily: host region still holds old sums
    int32_t slot = -1;      // staging slot while begun
    GradLayout layout;      // the sink's: dtypes, offsets, this rank's part
    std::vector<std::string> names;
    std::vector<uint64_t> view_bytes;       // per tensor, on the wire
    std::vector<lwo_dtype_t> view_dtypes;   // per tensor, the wire dtype
    std::vector<void*> ptrs;                // device addresses while begun
    uint64_t host_base = 0;
    // The last end's serial, whether it landed by DMA alone,
    // and an event recorded on the gradient stream after its copy.
    uint64_t end_serial = 0;
    bool end_direct = false;
    bool end_replayed = false;  // by a graph's launch: landed when added_serial_ says
    EventH landed = nullptr;
  };
  // What an end changes of a layer's host state (saved around a capture and
  // a launch).
  struct EndState {
    bool fresh, stale;
    uint64_t end_serial;
    bool end_direct, end_replayed;
  };
  struct Counters {
    uint64_t end_counter, n_transfers, bytes;
  };
  // One end captured into a graph: the persistent argument of its host
  // functions, the same at every launch.
  struct ReplayEnd {
    Grads* grads;
    uint32_t layer;
    bool direct;          // the copy lands in the host buffer itself
    bool assign;          // the job assigns (else adds)
    size_t staging;       // not direct: the staging buffer
    const uint8_t* src;   // ... its bytes
    uint64_t bytes;       // copied down
  };
  // The set's part of a capture and of the graph that keeps it.
  struct Replay {
    std::vector<std::unique_ptr<ReplayEnd>> ends;  // in the capture's order
    std::vector<int8_t> fresh;    // per layer: fresh at its first captured end (-1: none)
    std::vector<uint32_t> layers;  // the layers with ends, ascending
    std::vector<EndState> saved;   // every layer's state at the join
    Counters counters{};
    bool joined = false;           // the gradient stream is part of the capture
    bool callers = false;          // the graph is the caller's (a joined capture's)
    // The last arm's, for disarm.
    std::vector<EndState> armed;   // the ended layers' states before it (per `layers`)
    Counters armed_counters{};
  };
  enum class Capture { None, Capturing, Bound };
  struct Job {
    Grads* grads;
    uint32_t layer;
    const uint8_t* src;
    bool assign;
    size_t staging;  // the staging buffer it reads
    uint64_t serial;  // the end's serial
  };
  struct StagingWait {
    Grads* grads;
    size_t staging;
  };
  // Every layer of the pool, the trainable ones laid out by the sink.
  static std::vector<Layer> make_layers(Pool& pool, const uint8_t* trainable, const Sink& sink);
  static uint64_t max_wire_bytes(const std::vector<Layer>& layers);
  static SlotSet make_slots(Pool& pool, uint32_t depth, uint64_t bytes);
  static void post_job(void* job);       // host function: to the worker
  static void wait_staging(void* wait);  // host function: until the buffer is free
  // A replayed end's host functions (arg: its ReplayEnd, kept by the graph).
  static void replay_wait_staging(void* end);
  static void replay_landed(void* end);
  void enqueue_locked(std::unique_ptr<Job> job);  // under q_mu_: to the worker
  void wait_staging_free(size_t staging);
  // Refuses, naming `what`, while another pool's ring captures
  // (LWO_ERR_CAPTURING) or a graph holds the set (LWO_ERR_BUSY); joins the
  // capture of a ring of this pool at the first call in it. Under mu_.
  void check_capture(const char* what);
  // Throws LWO_ERR_CAPTURING, naming `what`, after a replay that was not
  // announced (unannounced_), until lwo_grads_zero.
  void check_announced(const char* what);
  void wait_fence(bool report_unannounced);
  // The graph that holds the set, for messages.
  const char* holder() const;
  void join_capture(const char* what);
  EndState end_state(const Layer& g) const {
    return {g.fresh, g.stale, g.end_serial, g.end_direct, g.end_replayed};
  }
  static void set_end_state(Layer& g, const EndState& e);
  Counters counters() const { return {end_counter_, n_transfers_, bytes_}; }
  void set_counters(const Counters& c);
  // Every staging slot's free event recorded on the gradient stream after
  // `after` (the capture's or the last launch's end): eager begins then
  // wait for the graph's readers. Under mu_.
  void free_slots_after(EventH after) noexcept;
  void work();                           // the worker thread
  void accumulate(const Job& job);
  void wait_worker();                    // until every posted job is done
  Layer& trainable_layer(uint32_t layer);
  Layer& begun_layer(uint32_t layer);  // trainable and begun
  int tensor_of(const Layer& g, uint32_t layer, const char* name) const;
  void end_locked(uint32_t layer, StreamH stream);
  // Checking mode: the layer's host gradients (this rank's elements) and
  // its staging slot after the copy down (on the gradient stream) hold
  // kCheckingByte.
  void poison_host(const Layer& g);
  void poison_slot(const Layer& g, DeviceSlot& s, StreamH d2h);

  Pool& pool_;
  Engine& engine_;
  uint32_t n_threads_;
  bool checking_;  // the engine's checking mode at creation
  std::unique_ptr<Sink> sink_;      // chosen once, before anything is made
  std::vector<Layer> layers_;       // under mu_; the layouts fixed once made
  uint64_t max_wire_ = 0;
  Charge slot_charge_;              // the engine's budget, before slots_
  SlotSet slots_;                   // device staging, max_wire_ bytes each
  std::vector<int32_t> slot_layer_;  // the layer begun in each slot, or -1
  std::mutex mu_;
  PinnedArena host_;                 // the host gradients
  std::vector<PinnedArena> staging_;  // host staging for converted / added copies
  size_t next_staging_ = 0;
  // The worker: jobs in the order the gradient stream posted them.
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  std::vector<uint8_t> staging_busy_;  // a posted job reads the buffer
  uint64_t pending_ = 0;               // posted, not finished
  bool stop_ = false;
  HostThread worker_;  // started by the engine's thread pool
  EventH done_ = nullptr;            // recorded on the gradient stream after each end
  uint64_t n_transfers_ = 0, bytes_ = 0;
  std::atomic<uint64_t> n_accumulated_{0}, accumulated_bytes_{0}, accumulate_ns_{0};
  std::mutex err_mu_;
  std::string async_error_;
  // A replay of the caller's graph launched without lwo_ring_capture_replay
  // before it: its first end that found no serial queued ("" if none), under
  // err_mu_, until lwo_grads_zero.
  std::string unannounced_;
  // The optimizer's hook.
  std::atomic<Reader*> reader_{nullptr};
  uint64_t end_counter_ = 0;            // under mu_
  std::vector<uint64_t> added_serial_;  // per layer, under q_mu_: the last end added
  // CUDA graphs (under mu_, but replay_serials_ under q_mu_).
  Capture capture_ = Capture::None;
  std::unique_ptr<Replay> replay_;
  EventH join_event_ = nullptr;   // the gradient stream's join and leave
  EventH last_replay_ = nullptr;  // the graph's event after its last launch
  std::vector<std::deque<uint64_t>> replay_serials_;  // per layer: armed ends not yet landed
};

}  // namespace lwo
