#include "shard_sim.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lwo {
namespace plan {
namespace {

// A stream: operations run in the order they are enqueued.
struct Stream {
  double free_at = 0.0;
  double busy = 0.0;
  // Runs an operation of `ms` once the stream is free and `ready`; its end.
  double run(double ready, double ms) {
    double start = std::max(free_at, ready);
    free_at = start + ms;
    busy += ms;
    return free_at;
  }
};

double ms_of(double bytes, double gbps) { return bytes / (gbps * 1e6); }

// A collective of `ms` on `coll` once `ready`. The compute it overlaps loses
// cost x ms: added to the next compute operation (`stolen`).
double collective(Stream& coll, double ready, double ms, double cost, double* stolen) {
  *stolen += cost * ms;
  return coll.run(ready, ms);
}

}  // namespace

ShardPrediction simulate_shard_step(const ShardStep& s, const ShardRates& r) {
  if (s.gpus_per_node == 0 || s.nodes == 0 || s.n_layers == 0 || s.depth == 0 ||
      s.record_bytes == 0 || (s.train && s.grads_depth == 0))
    throw std::invalid_argument("shard step: ranks, nodes, layers, depth, grads depth and "
                                "record bytes must be positive");
  for (double v : {r.link_gbps, r.duplex_h2d_gbps, r.duplex_d2h_gbps, r.host_gbps,
                   r.all_gather_gbps, r.reduce_scatter_gbps, r.inter_node_gbps})
    if (!(v > 0.0)) throw std::invalid_argument("shard step: every rate must be positive");
  if (!(r.collective_compute_cost >= 0.0))
    throw std::invalid_argument("shard step: collective_compute_cost must be 0 or more");
  const uint32_t N = s.gpus_per_node, M = s.nodes, L = s.n_layers;
  const double shard = static_cast<double>(s.record_bytes) / N;
  const double gshard = static_cast<double>(s.grad_bytes) / N;
  // The ranks of a node share its host memory's bandwidth in each direction
  // (as measured: two H200 links together 100 to 110 GB/s up, and as much
  // down while they copy up).
  const double up_fwd = std::min(r.link_gbps, r.host_gbps / N);
  const double up_bwd = std::min(r.duplex_h2d_gbps, r.host_gbps / N);
  const double down = std::min(r.duplex_d2h_gbps, r.host_gbps / N);

  // The schedule: the forward pass, then (training) the backward pass.
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < L; ++l) order.push_back(l);
  if (s.train)
    for (uint32_t l = L; l-- > 0;) order.push_back(l);
  const size_t n = order.size();

  Stream h2d, coll, comp, d2h;
  struct Slot {
    int64_t layer = -1;
    double ready = 0.0;  // its record is in the slot
    double freed = 0.0;  // its last reader is done
  };
  std::vector<Slot> slots(s.depth);
  std::vector<int> slot_of(n, -1);
  std::vector<double> grad_slot_free(std::max<uint32_t>(s.grads_depth, 1), 0.0);
  ShardPrediction p;
  size_t staged = 0;
  double stolen = 0.0;  // compute ms the collectives since the last compute took
  uint32_t grads_done = 0;
  auto stage = [&](size_t j) {
    const bool backward = j >= L;
    const uint32_t layer = order[j];
    // A hit: the layer is still in a slot (held or not): no copy.
    for (uint32_t q = 0; q < s.depth; ++q)
      if (slots[q].layer == layer) {
        slot_of[j] = static_cast<int>(q);
        return;
      }
    // A miss: the slot released longest ago among those no later step holds.
    int best = -1;
    for (uint32_t q = 0; q < s.depth; ++q) {
      bool held = false;
      for (size_t k = (j >= s.depth ? j - s.depth + 1 : 0); k < j; ++k)
        held = held || slot_of[k] == static_cast<int>(q);
      if (!held && (best < 0 || slots[q].freed < slots[best].freed)) best = static_cast<int>(q);
    }
    Slot& sl = slots[best];
    double t = h2d.run(sl.freed, ms_of(shard, backward ? up_bwd : up_fwd));
    if (N > 1)
      t = collective(coll, t, ms_of(static_cast<double>(s.record_bytes), r.all_gather_gbps),
                     r.collective_compute_cost, &stolen);
    sl.layer = layer;
    sl.ready = t;
    slot_of[j] = best;
    ++p.copies;
  };
  for (size_t i = 0; i < n; ++i) {
    // At step i the ring holds steps i .. i+depth-1: stage what is missing.
    while (staged < n && staged < i + s.depth) stage(staged++);
    const bool backward = i >= L;
    Slot& sl = slots[slot_of[i]];
    if (!backward) {
      sl.freed = std::max(sl.freed, comp.run(sl.ready, s.fwd_ms + stolen));
      stolen = 0.0;
      if (i + 1 == L) p.fwd_ms = sl.freed;
      continue;
    }
    double& gfree = grad_slot_free[grads_done % grad_slot_free.size()];
    double done = comp.run(std::max(sl.ready, gfree), s.bwd_ms + stolen);
    stolen = 0.0;
    sl.freed = std::max(sl.freed, done);
    if (s.grad_bytes) {
      double t = done;
      const double cost = r.collective_compute_cost;
      if (N > 1)
        t = collective(coll, t, ms_of(static_cast<double>(s.grad_bytes), r.reduce_scatter_gbps),
                       cost, &stolen);
      if (M > 1)
        t = collective(coll, t, ms_of(2.0 * (M - 1) / M * gshard, r.inter_node_gbps), cost,
                       &stolen);
      gfree = d2h.run(t, ms_of(gshard, down));
    }
    ++grads_done;
  }
  p.step_ms = std::max({comp.free_at, d2h.free_at, coll.free_at, h2d.free_at});
  p.h2d_ms = h2d.busy;
  p.d2h_ms = d2h.busy;
  p.collective_ms = coll.busy;
  p.compute_ms = comp.busy;
  p.resident_ms = L * (s.fwd_ms + (s.train ? s.bwd_ms : 0.0));
  p.per_gpu_gbps = static_cast<double>(n) * s.record_bytes / (p.step_ms * 1e6);
  return p;
}

}  // namespace plan
}  // namespace lwo
