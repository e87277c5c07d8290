// Host weight pools: L layers, each a record of named tensors, in memory the
// GPU reads by DMA (a pinned arena the pool owns, or caller memory registered
// in place). Host-only logic; device calls go through the Backend seam.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "arena.h"
#include "src/checkpoint/checkpoint.h"
#include "engine.h"
#include "layout.h"

namespace lwo {

// One host-to-device copy of a layer: `bytes` from `src` to record offset
// `dst_offset`.
struct CopyRun {
  uint64_t dst_offset;
  const uint8_t* src;
  uint64_t bytes;
};

class Pool {
 public:
  struct Layer {
    RecordLayout layout;
    std::vector<CopyRun> runs;  // how to move the record; one run if contiguous
    uint8_t* host = nullptr;    // record base in host memory (null if scattered;
                                // the shard, for sharded pools)
    uint64_t shard_bytes = 0;   // sharded pools: S, this layer's bytes per rank
  };

  static std::unique_ptr<Pool> create_pinned(Engine& engine, const lwo_layer_desc* layers,
                                             uint32_t n_layers, const lwo_pool_config& cfg);
  static std::unique_ptr<Pool> create_registered(Engine& engine, const lwo_layer_desc* layers,
                                                 uint32_t n_layers,
                                                 const lwo_host_region* regions,
                                                 uint32_t n_regions,
                                                 const lwo_pool_config& cfg);
  // A pool over a mapped checkpoint: `layers[l]` lists entry indices of layer
  // l; `strip[l]` is a name prefix to drop (pattern mappings), or "". The
  // files are registered for DMA unless `staged` (or registration is
  // refused), in which case rings copy through pinned staging buffers.
  static std::unique_ptr<Pool> create_from_checkpoint(
      Engine& engine, std::shared_ptr<Checkpoint> ckpt,
      const std::vector<std::vector<size_t>>& layers, const std::vector<std::string>& strip,
      bool staged, const char* call);
  // A pinned pool of this rank's shard of every record (see lwo.h).
  static std::unique_ptr<Pool> create_sharded(Engine& engine, const lwo_layer_desc* layers,
                                              uint32_t n_layers, void* comm,
                                              const lwo_pool_config& cfg);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  Engine& engine() { return engine_; }
  uint32_t n_layers() const { return static_cast<uint32_t>(layers_.size()); }
  bool registered() const { return registered_; }
  // Copies must go through pinned staging (the sources are not DMA-ready).
  bool staged() const { return staged_; }
  const Checkpoint* checkpoint() const { return ckpt_.get(); }
  // Sharded pools: the communicator, this rank and the number of ranks.
  void* comm() const { return comm_; }
  int rank() const { return rank_; }
  int n_ranks() const { return n_ranks_; }
  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t max_record_bytes() const { return max_record_; }

  // Range-checked layer access; `call` names the API call for messages.
  const Layer& layer(uint32_t id, const char* call) const;
  // Range- and name-checked tensor index.
  uint32_t tensor_index(uint32_t layer, const char* name, const char* call) const;

  void write(uint32_t layer, const char* name, const void* src, uint64_t bytes);

  // Host bytes of a layer changed: rings must copy it again rather than reuse
  // a slot that holds the old bytes. lwo_pool_write calls it itself.
  void changed(uint32_t layer, const char* call);
  uint64_t version(uint32_t layer) const { return versions_[layer].load(std::memory_order_acquire); }

  std::atomic<int> n_rings{0};
  std::atomic<int> n_grads{0};

 private:
  Pool(Engine& engine, bool registered) : engine_(engine), registered_(registered) {}
  void build_layouts(const lwo_layer_desc* layers, uint32_t n_layers, const char* call);

  struct Region {
    uint8_t* data;
    uint64_t bytes;
    bool we_registered;
  };

  Engine& engine_;
  bool registered_;
  std::vector<Layer> layers_;
  std::unique_ptr<std::atomic<uint64_t>[]> versions_;  // per layer, bumped on change
  uint64_t total_bytes_ = 0;
  uint64_t max_record_ = 0;
  PinnedArena arena_;  // pinned pools
  // Registered caller memory.
  std::vector<Region> regions_;
  // Checkpoint pools.
  std::shared_ptr<Checkpoint> ckpt_;
  bool staged_ = false;
  // Sharded pools.
  void* comm_ = nullptr;
  int rank_ = 0, n_ranks_ = 1;
};

}  // namespace lwo
