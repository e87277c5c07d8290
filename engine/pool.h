// Host weight pools: L layers, each a record of named tensors, in memory the
// GPU reads by DMA (a pinned arena the pool owns, caller memory registered in
// place, a mapped checkpoint, or this rank's shard of every record), and the
// source that moves a layer's bytes into a ring slot. Host-only logic;
// device calls go through the Backend seam.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "arena.h"
#include "engine.h"
#include "layout.h"
#include "source.h"
#include "src/checkpoint/checkpoint.h"

namespace lwo {

class Pool {
 public:
  using Layer = HostLayer;

  static std::unique_ptr<Pool> create_pinned(Engine& engine, const lwo_layer_desc* layers,
                                             uint32_t n_layers, uint32_t n_threads);
  static std::unique_ptr<Pool> create_registered(Engine& engine, const lwo_layer_desc* layers,
                                                 uint32_t n_layers,
                                                 const lwo_host_region* regions,
                                                 uint32_t n_regions);
  // A pool over a mapped checkpoint, laid out by `mapping`. The files are
  // registered for DMA unless `staged` (or registration is refused), in
  // which case rings copy through pinned staging buffers.
  static std::unique_ptr<Pool> create_from_checkpoint(Engine& engine,
                                                      std::shared_ptr<Checkpoint> ckpt,
                                                      const Checkpoint::Mapping& mapping,
                                                      bool staged);
  // A pinned pool of this rank's shard of every record (see lwo.h).
  static std::unique_ptr<Pool> create_sharded(Engine& engine, const lwo_layer_desc* layers,
                                              uint32_t n_layers, void* comm,
                                              uint32_t n_threads);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  Engine& engine() { return engine_; }
  Source& source() { return *source_; }
  lwo_pool_kind_t kind() const { return kind_; }
  uint32_t n_layers() const { return static_cast<uint32_t>(layers_.size()); }
  // Sharded pools: the communicator (else null), this rank and the number of
  // ranks (0 and 1 otherwise: an unsharded pool is one shard).
  void* communicator() const { return communicator_; }
  int rank() const { return rank_; }
  int n_ranks() const { return n_ranks_; }
  bool holds_whole() const { return n_ranks_ == 1; }
  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t max_record_bytes() const { return max_record_; }

  // Range-checked layer access (LWO_ERR_OUT_OF_RANGE).
  const Layer& layer(uint32_t id) const;
  // Range- and name-checked tensor index (LWO_ERR_NOT_FOUND).
  uint32_t tensor_index(uint32_t layer, const char* name) const;

  // The part of tensor `ti` of `layer` in rank `rank`'s shard: elements
  // [first, first + n) of the tensor, at byte `shard_offset` of that shard.
  // For a pool that is not sharded (rank 0 of 1) it is the whole tensor.
  struct TensorPart {
    uint64_t first = 0, n = 0, shard_offset = 0;
  };
  TensorPart tensor_part(uint32_t layer, uint32_t ti, int rank) const;

  // The lwo_pool_*_host and _shard_* queries (see lwo.h).
  void layer_host(uint32_t layer, void** data, uint64_t* bytes) const;
  void tensor_host(uint32_t layer, uint32_t ti, void** data, uint64_t* bytes) const;
  void shard_host(uint32_t layer, void** data, uint64_t* record_offset, uint64_t* bytes) const;
  void shard_tensor(uint32_t layer, uint32_t ti, void** data, uint64_t* first,
                    uint64_t* n) const;

  // Writes bytes [offset, offset + bytes) of a tensor (this rank's part of
  // them, for sharded pools) and marks the layer changed.
  // `whole`: lwo_pool_write, whose bytes must be the tensor's size.
  void write(uint32_t layer, const char* name, uint64_t offset, const void* src, uint64_t bytes,
             bool whole);
  // lwo_pool_write_quantized: quantizes src (rows x cols of src_dtype,
  // exactly src_bytes) into quantized tensor `name` of `layer`.
  void write_quantized(uint32_t layer, const char* name, const void* src, lwo_dtype_t src_dtype,
                       uint64_t src_bytes, uint32_t n_threads);
  // The first quantized tensor of `layer` (index), or -1.
  int first_quantized(uint32_t layer) const;

  // Host bytes of a layer changed: rings must copy it again rather than reuse
  // a slot that holds the old bytes. write() calls it itself.
  void changed(uint32_t layer);
  uint64_t version(uint32_t layer) const { return versions_[layer].load(std::memory_order_acquire); }
  // Resident layers of a ring in a CUDA graph the caller captured
  // (lwo_ring_capture_join until lwo_ring_capture_release) are held: that
  // graph's replays copy nothing into their slots, so a change could never
  // reach them. hold() counts per layer; check_not_held throws LWO_ERR_BUSY,
  // naming `what` and the layer, while one is held. Writers of the host bytes
  // (lwo_pool_write, _write_quantized, _layer_changed, lwo_optim_step and
  // lwo_optim_write of a master) check first; a delayed optimizer's
  // lwo_optim_wait keeps a held layer's update in its masters.
  void hold(uint32_t layer, int delta) { held_[layer].fetch_add(delta); }
  bool held(uint32_t layer) const { return layer < layers_.size() && held_[layer].load() > 0; }
  void check_not_held(uint32_t layer, const char* what) const;

  // Throws LWO_ERR_BUSY while rings or gradient sets of the pool exist.
  void check_destroyable() const;
  // Live rings and gradient sets of the pool (they count themselves).
  std::atomic<int> n_rings{0};
  std::atomic<int> n_grads{0};

  // A writer of the host bytes outside the caller's calls (the
  // optimizer, engine/optimizer.h). Ring stages of a layer first wait until
  // it is done writing that layer (it marks the layer changed before it
  // starts, so the stage copies the new bytes).
  struct Writer {
    virtual ~Writer() = default;
    virtual void wait_layer(uint32_t layer) = 0;  // any layer id; no-op if not written
  };
  std::atomic<Writer*> writer{nullptr};

 private:
  Pool(Engine& engine, lwo_pool_kind_t kind) : engine_(engine), kind_(kind) {
    engine_.n_pools.fetch_add(1);
  }
  void build_layouts(const lwo_layer_desc* layers, uint32_t n_layers, bool want_host_data);
  void finish_layers();  // versions, per-tensor arrays, totals

  struct Region {
    uint8_t* data;
    uint64_t bytes;
    bool we_registered;
  };

  Engine& engine_;
  lwo_pool_kind_t kind_;
  std::vector<Layer> layers_;
  std::unique_ptr<std::atomic<uint64_t>[]> versions_;  // per layer, bumped on change
  std::unique_ptr<std::atomic<int>[]> held_;           // per layer, hold() counts
  uint64_t total_bytes_ = 0;
  uint64_t max_record_ = 0;
  PinnedArena arena_;            // pinned and sharded pools
  std::vector<Region> regions_;  // registered caller memory or checkpoint files
  HostCharge regions_charge_;    // their bytes, on the engine's host budget
  std::shared_ptr<Checkpoint> ckpt_;
  void* communicator_ = nullptr;
  int rank_ = 0, n_ranks_ = 1;
  std::unique_ptr<Source> source_;  // destroyed first
};

}  // namespace lwo
