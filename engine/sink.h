// Sinks: how a layer's gradient in a staging slot becomes this rank's host
// gradients. The gradient set (engine/grads.h) owns one, chosen once when it
// is made (Sink::make); it only chooses the staging slot, copies the sink's
// part of the slot down the gradient stream and adds it on the host. A new
// way of summing gradients (over ranks, or compressed) is a new sink, not a
// branch in the gradient set.
//
//   LocalSink    the whole record, in each tensor's dtype or f32 (the mode),
//                goes down the gradient stream once the caller's writes are done
//   ShardedSink  the f32 record is summed over the ranks on the collective
//                stream, each rank keeping the gradients of its weight shard;
//                with a replica communicator (the ranks that hold the same
//                shard in other groups: other nodes) that part is then summed
//                over it too; only that part goes down
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine.h"
#include "slots.h"
#include "source.h"

namespace lwo {

class Pool;

// The dtypes of the wire and the host buffers (lwo.h, LWO_GRADS_*).
enum class GradsMode { kNative, kF32, kNativeWire };

// One tensor of a layer's gradient: its dtype in the staging slot (the wire)
// and in host memory, its offsets in the wire record and in the layer's whole
// host record (each tensor at the next multiple of LWO_RECORD_ALIGN), and the
// part of it this rank keeps: elements [first, first + count), at `copy_at`
// in the bytes copied down (wire bytes [lo, hi) of the layer) and at
// `host_at` in the layer's host region.
struct GradTensor {
  lwo_dtype_t wire;
  lwo_dtype_t host;
  uint64_t n;         // elements
  uint64_t wire_off;  // in the slot record
  uint64_t host_off;  // in the whole host record
  uint64_t first = 0, count = 0;
  uint64_t copy_at = 0, host_at = 0;
};

// A trainable layer's gradient as its sink lays it out.
struct GradLayout {
  std::vector<GradTensor> tensors;
  uint64_t wire_bytes = 0;  // the slot record
  // This rank copies wire bytes [lo, hi) down, into a host region of
  // host_bytes.
  uint64_t lo = 0, hi = 0;
  uint64_t host_bytes = 0;
  // Sharded: bounds[q] .. bounds[q+1] is rank q's part of the wire record
  // (empty otherwise).
  std::vector<uint64_t> bounds;
  bool direct = false;  // every tensor's wire dtype is its host dtype, so the
                        // copied bytes are laid out as the host region
};

class Sink {
 public:
  // The pool's sink: sharded pools a ShardedSink, every other pool a
  // LocalSink. `replica` (null: none) is a communicator over which a sharded
  // pool's parts are summed too. Throws LWO_ERR_UNSUPPORTED for a mode the
  // sink cannot carry and for a replica communicator with a pool that is not
  // sharded, LWO_ERR_INVALID_ARGUMENT for a replica communicator that is the
  // pool's or on another device (Backend::comm_info).
  static std::unique_ptr<Sink> make(Pool& pool, GradsMode mode, void* replica = nullptr);
  virtual ~Sink() = default;
  Sink(const Sink&) = delete;
  Sink& operator=(const Sink&) = delete;

  // The layout of a trainable layer's gradient. Throws
  // LWO_ERR_INVALID_ARGUMENT for a tensor that is not f32, bf16 or f16.
  GradLayout lay_out(uint32_t layer, const HostLayer& l) const;
  // The communicators of the set's collective steps (Engine::collective_step),
  // or null: the pool's, and the replica communicator.
  virtual void* communicator() const { return nullptr; }
  virtual void* replica_communicator() const { return nullptr; }
  // The caller's stream recorded slot.ready after its last write of the
  // layer's gradient: makes the gradient stream wait until the slot holds
  // this rank's part [lo, hi), summed over the ranks. May use slot.aux.
  virtual void reduce(const GradLayout& g, DeviceSlot& slot, StreamH gradient_stream) = 0;

 protected:
  Sink(Engine& engine, GradsMode mode) : engine_(engine), mode_(mode) {}
  // The dtypes of a tensor of dtype t on the wire and in host memory.
  virtual lwo_dtype_t wire_dtype(lwo_dtype_t t) const = 0;
  virtual lwo_dtype_t host_dtype(lwo_dtype_t t) const = 0;
  // Sets the part of every tensor this rank keeps, [lo, hi), bounds and
  // host_bytes; `whole_host` is the bytes of the whole host record.
  virtual void keep(const HostLayer& l, uint64_t whole_host, GradLayout& g) const = 0;

  Engine& engine_;
  GradsMode mode_;
};

class LocalSink : public Sink {
 public:
  LocalSink(Engine& engine, GradsMode mode) : Sink(engine, mode) {}
  void reduce(const GradLayout& g, DeviceSlot& slot, StreamH gradient_stream) override;

 protected:
  lwo_dtype_t wire_dtype(lwo_dtype_t t) const override;
  lwo_dtype_t host_dtype(lwo_dtype_t t) const override;
  void keep(const HostLayer& l, uint64_t whole_host, GradLayout& g) const override;
};

class ShardedSink : public Sink {
 public:
  // Throws LWO_ERR_UNSUPPORTED for LWO_GRADS_NATIVE_WIRE (the sum is f32).
  // `replica`: null, or the communicator this rank's part is all-reduced
  // over after the reduction over `communicator`.
  ShardedSink(Engine& engine, GradsMode mode, void* communicator, int rank, int n_ranks,
              void* replica = nullptr);
  void* communicator() const override { return communicator_; }
  void* replica_communicator() const override { return replica_; }
  void reduce(const GradLayout& g, DeviceSlot& slot, StreamH gradient_stream) override;

 protected:
  lwo_dtype_t wire_dtype(lwo_dtype_t) const override { return LWO_DTYPE_F32; }
  lwo_dtype_t host_dtype(lwo_dtype_t) const override { return LWO_DTYPE_F32; }
  void keep(const HostLayer& l, uint64_t whole_host, GradLayout& g) const override;

 private:
  void* communicator_;
  int rank_, n_ranks_;
  void* replica_;
};

}  // namespace lwo
