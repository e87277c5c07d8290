// Sources: how a pool's host bytes reach a ring slot. The pool owns one; the
// ring only chooses the slot, orders it after its previous readers, asks the
// source to fill it, and keeps its table. A new transport (quantized, NVMe,
// resident) is a new source, not a branch in the ring.
//
//   DirectSource   copy runs straight from DMA-ready memory (a pinned arena,
//                  registered caller memory, a registered checkpoint mapping)
//   StagedSource   runs packed by host threads into two pinned staging
//                  buffers on a fill stream, then one copy each
//   ShardedSource  this rank's shard up its own link, then an all-gather of
//                  the record into the slot on the collective stream
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arena.h"
#include "engine.h"
#include "layout.h"
#include "slots.h"

namespace lwo {

class Checkpoint;

// One host-to-device copy of a layer: `bytes` from `src` to record offset
// `dst_offset`.
struct CopyRun {
  uint64_t dst_offset;
  const uint8_t* src;
  uint64_t bytes;
};

// A layer as the pool holds it.
struct HostLayer {
  RecordLayout layout;
  std::vector<CopyRun> runs;  // how to move the record; one run if contiguous
  uint8_t* host = nullptr;    // this rank's bytes of the record in host memory
                              // (the shard, for sharded pools), or null if
                              // the layer is scattered
  uint64_t shard_bytes = 0;   // S: bytes of the record each rank holds (the
                              // record, unless sharded)
  // The layout's tensor sizes and dtypes as arrays, for layer views.
  std::vector<uint64_t> tensor_bytes;
  std::vector<lwo_dtype_t> tensor_dtypes;
};

class Source {
 public:
  struct Moved {
    uint64_t bytes = 0;           // run bytes copied host to device
    uint64_t n_copies = 0;        // host-to-device copies enqueued
    bool ready_elsewhere = false; // slot.ready was recorded on another stream
                                  // than the transfer stream
  };

  Source(Engine& engine, const Checkpoint* ckpt) : engine_(engine), ckpt_(ckpt) {}
  virtual ~Source() = default;
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  // A ring of slots of `slot_bytes` is being created: get what filling them
  // needs (throws LWO_ERR_OUT_OF_MEMORY).
  virtual void attach(uint64_t slot_bytes) {}
  // Throws LWO_ERR_FILE_CHANGED (LWO_ERR_IO) once a mapped file changed, or
  // once a copy out of it found it cut short (check_copies).
  void check_readable() const;
  // Throws LWO_ERR_FILE_CHANGED once a copy out of a mapped file faulted
  // because the file was cut short; from then on, for good (one atomic load
  // until then).
  virtual void check_copies() const {}
  // Enqueues the move of `l` into `slot.dev`, starting on the engine's
  // transfer stream (which already waits until the slot may be written), and
  // records slot.ready once every byte is there. May use slot.aux.
  virtual Moved fill(const HostLayer& l, DeviceSlot& slot) = 0;

 protected:
  Engine& engine_;
  const Checkpoint* ckpt_;
};

class DirectSource : public Source {
 public:
  using Source::Source;
  Moved fill(const HostLayer& l, DeviceSlot& slot) override;
};

class StagedSource : public Source {
 public:
  using Source::Source;
  ~StagedSource() override;
  void attach(uint64_t slot_bytes) override;
  Moved fill(const HostLayer& l, DeviceSlot& slot) override;
  void check_copies() const override;
  // A host thread's copy out of the checkpoint's mapping read `addr`, past
  // the end of a file cut short: remembers which file, for check_copies.
  void copy_faulted(const void* addr) noexcept;

 private:
  struct Staging {
    PinnedArena buf;
    EventH ready = nullptr, free = nullptr;
    bool used = false;
  };
  std::mutex mu_;  // rings of one pool may stage from several threads
  std::vector<Staging> staging_;
  StreamH fill_stream_ = nullptr;
  size_t next_ = 0;
  std::atomic<bool> faulted_{false};
  mutable std::mutex fault_mu_;  // not mu_: a fill may run inside fill()
  std::string fault_;            // the message of the first fault
};

class ShardedSource : public Source {
 public:
  ShardedSource(Engine& engine, void* comm, int rank)
      : Source(engine, nullptr), communicator_(comm), rank_(rank) {}
  Moved fill(const HostLayer& l, DeviceSlot& slot) override;

 private:
  void* communicator_;
  int rank_;
};

}  // namespace lwo
