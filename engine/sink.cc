#include "sink.h"

#include <algorithm>

#include "pool.h"
#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lwo {

std::unique_ptr<Sink> Sink::make(Pool& pool, GradsMode mode, void* replica) {
  if (replica) {
    if (!pool.communicator())
      fail(LWO_ERR_UNSUPPORTED,
           "replica communicator %p with a pool that is not sharded: a replica communicator "
           "sums the gradient shards of a sharded pool (lwo_pool_create_sharded) over the "
           "ranks that hold the same shard",
           replica);
    if (replica == pool.communicator())
      fail(LWO_ERR_INVALID_ARGUMENT,
           "replica communicator %p is the pool's own communicator: it must join the ranks "
           "that hold the same shard (in other groups), not the ranks that share the records",
           replica);
    // A live communicator on the engine's device, or it throws.
    DeviceScope scope(pool.engine());
    int n = 0, r = 0;
    pool.engine().gpu().comm_info(replica, &n, &r);
  }
  if (pool.communicator())
    return std::make_unique<ShardedSink>(pool.engine(), mode, pool.communicator(), pool.rank(),
                                         pool.n_ranks(), replica);
  return std::make_unique<LocalSink>(pool.engine(), mode);
}

GradLayout Sink::lay_out(uint32_t layer, const HostLayer& l) const {
  GradLayout g;
  uint64_t woff = 0, hoff = 0;
  g.direct = true;
  for (const TensorLayout& t : l.layout.tensors) {
    if (t.dtype != LWO_DTYPE_F32 && t.dtype != LWO_DTYPE_BF16 && t.dtype != LWO_DTYPE_F16)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "layer %u tensor '%s' is %s; trainable tensors must be f32, bf16 or f16 "
           "(mark the layer frozen)", layer, t.name.c_str(), dtype_name(t.dtype));
    GradTensor gt;
    gt.wire = wire_dtype(t.dtype);
    gt.host = host_dtype(t.dtype);
    // A quantized tensor's gradient is dense: rows x cols of its logical dtype.
    gt.n = t.quant != LWO_QUANT_NONE ? uint64_t(t.shape[0]) * uint64_t(t.shape[1])
                                     : t.bytes / dtype_size(t.dtype);
    gt.wire_off = woff;
    gt.host_off = hoff;
    woff = align_up(woff + gt.n * dtype_size(gt.wire), LWO_RECORD_ALIGN);
    hoff = align_up(hoff + gt.n * dtype_size(gt.host), LWO_RECORD_ALIGN);
    g.direct = g.direct && gt.wire == gt.host;
    g.tensors.push_back(gt);
  }
  g.wire_bytes = woff;
  keep(l, hoff, g);
  return g;
}

// ---- LocalSink ----

lwo_dtype_t LocalSink::wire_dtype(lwo_dtype_t t) const {
  return mode_ == GradsMode::kF32 ? LWO_DTYPE_F32 : t;
}

lwo_dtype_t LocalSink::host_dtype(lwo_dtype_t t) const {
  return mode_ == GradsMode::kNative ? t : LWO_DTYPE_F32;
}

void LocalSink::keep(const HostLayer&, uint64_t whole_host, GradLayout& g) const {
  // Every tensor, whole: the copy is the wire record, the host region the
  // whole host record.
  g.lo = 0;
  g.hi = g.wire_bytes;
  g.host_bytes = whole_host;
  for (GradTensor& t : g.tensors) {
    t.first = 0;
    t.count = t.n;
    t.copy_at = t.wire_off;
    t.host_at = t.host_off;
  }
}

void LocalSink::reduce(const GradLayout&, DeviceSlot& slot, StreamH gradient_stream) {
  // One rank: the slot holds the sum once the caller's writes are done.
  engine_.gpu().stream_wait(gradient_stream, slot.ready);
}

// ---- ShardedSink ----

ShardedSink::ShardedSink(Engine& engine, GradsMode mode, void* communicator, int rank,
                         int n_ranks, void* replica)
    : Sink(engine, mode), communicator_(communicator), rank_(rank), n_ranks_(n_ranks),
      replica_(replica) {
  if (mode == GradsMode::kNativeWire)
    fail(LWO_ERR_UNSUPPORTED,
         "the pool is sharded over %d ranks: its gradients are summed over the ranks in "
         "f32, so LWO_GRADS_NATIVE_WIRE is not supported", n_ranks);
}

void ShardedSink::keep(const HostLayer& l, uint64_t, GradLayout& g) const {
  // Rank q owns the gradients of the weight bytes [q*S, (q+1)*S): map each
  // boundary q*S of the weight record into the f32 wire record. Offsets and
  // S are multiples of LWO_RECORD_ALIGN, so every boundary falls between
  // elements, and the mapped one on a multiple of 4.
  const RecordLayout& rl = l.layout;
  const uint64_t S = l.shard_bytes;
  const int n = n_ranks_;
  const uint64_t woff = g.wire_bytes;
  g.bounds.assign(static_cast<size_t>(n) + 1, woff);
  for (int q = 0; q <= n; ++q) {
    uint64_t b = S * static_cast<uint64_t>(q);
    for (size_t i = 0; i < rl.tensors.size(); ++i) {
      const TensorLayout& t = rl.tensors[i];
      if (b < t.offset + t.bytes) {
        const uint64_t w = g.tensors[i].wire_off;
        g.bounds[q] = b <= t.offset ? w : w + (b - t.offset) / dtype_size(t.dtype) * 4;
        break;
      }
    }
  }
  g.bounds[0] = 0;
  g.bounds[static_cast<size_t>(n)] = woff;
  g.lo = g.bounds[static_cast<size_t>(rank_)];
  g.hi = g.bounds[static_cast<size_t>(rank_) + 1];
  g.host_bytes = g.hi - g.lo;
  // This rank's elements of each tensor: those whose f32 wire bytes lie in
  // [lo, hi); the copy and the host region both start at wire byte lo.
  for (GradTensor& t : g.tensors) {
    const uint64_t wb = std::max(t.wire_off, g.lo), we = std::min(t.wire_off + t.n * 4, g.hi);
    if (wb >= we) continue;  // none: count 0
    t.first = (wb - t.wire_off) / 4;
    t.count = (we - wb) / 4;
    t.copy_at = wb - g.lo;
    t.host_at = wb - g.lo;
  }
}

void ShardedSink::reduce(const GradLayout& g, DeviceSlot& slot, StreamH gradient_stream) {
  // Sum the layer over the ranks on the collective stream (and this rank's
  // part over its replicas after); the part then goes down its own link.
  Backend& gpu = engine_.gpu();
  StreamH cs = engine_.collective_stream();
  gpu.stream_wait(cs, slot.ready);
  gpu.reduce_owned(slot.dev, g.bounds.data(), communicator_, cs);
  if (replica_) gpu.all_reduce(slot.dev + g.lo, (g.hi - g.lo) / 4, replica_, cs);
  gpu.event_record(slot.aux, cs);
  gpu.stream_wait(gradient_stream, slot.aux);
}

}  // namespace lwo
