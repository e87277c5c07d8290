// A simulator of one step of a sharded model (lwo_pool_create_sharded) on M
// nodes of N GPUs each, in the hierarchical layout: each node's host holds
// the weights once, sharded over its N ranks (each rank copies 1/N of every
// record up its own link, the ring all-gathers the record inside the node);
// gradients are reduce-scattered inside the node to the shard owners, then
// all-reduced across the nodes (each rank with the rank of the same shard on
// every other node), and each rank's part goes down its link.
//
// One rank is simulated (the ranks are alike): its four streams (transfer,
// collective, compute, gradient) as queues in lwo's program order (the
// schedule's stage-ahead with a ring of `depth` slots, a hit where a layer is
// still in a slot, gradient staging of `grads_depth` slots), each operation
// starting once its stream is free and its inputs are done. Rates in 1e9
// bytes per second; compute in ms per layer.
#pragma once

#include <cstdint>
#include <vector>

namespace lwo {
namespace plan {

struct ShardRates {
  double link_gbps = 54.0;          // one GPU's H2D alone
  double duplex_h2d_gbps = 50.7;    // H2D while D2H runs on the same link
  double duplex_d2h_gbps = 50.9;    // D2H while H2D runs
  double host_gbps = 110.0;         // host memory bandwidth of a node, shared by its ranks' copies
  double all_gather_gbps = 486.0;   // inside a node, bytes of the gathered record per second
  double reduce_scatter_gbps = 486.0;  // inside a node, bytes of the whole gradient per second
  double inter_node_gbps = 50.0;    // one GPU's rate across nodes (its NIC's share)
  // Compute time lost per ms of a collective (NCCL's kernels take SMs from
  // the GEMMs they overlap). Fitted, not measured: with 0.7 the 2-GPU
  // training step of docs/PERFORMANCE.md (scripts/scale: 174.7 ms) comes out
  // at 179.1 ms (1.025x); with 0 at 155.1 (0.89x).
  double collective_compute_cost = 0.7;
};

struct ShardStep {
  uint32_t gpus_per_node = 1;  // N
  uint32_t nodes = 1;          // M
  uint32_t n_layers = 32;
  uint64_t record_bytes = 0;   // each layer's weights
  uint64_t grad_bytes = 0;     // each layer's gradient on the wire (f32 on sharded pools)
  double fwd_ms = 0.0;         // compute per layer
  double bwd_ms = 0.0;
  bool train = true;           // forward + backward with gradients; false: a forward
  uint32_t depth = 2;          // ring slots
  uint32_t grads_depth = 2;    // gradient staging slots
};

struct ShardPrediction {
  double step_ms = 0.0;
  double fwd_ms = 0.0;              // the forward pass's part (to the end of its last compute)
  uint32_t copies = 0;              // records copied (misses), per rank
  double h2d_ms = 0.0, d2h_ms = 0.0, collective_ms = 0.0, compute_ms = 0.0;  // busy times
  double per_gpu_gbps = 0.0;        // record bytes into this GPU's slots per second of the step
  double resident_ms = 0.0;         // compute alone
};

// Throws std::invalid_argument for zero ranks, layers, depth or record
// bytes, or a rate that is not positive.
ShardPrediction simulate_shard_step(const ShardStep& step, const ShardRates& rates);

}  // namespace plan
}  // namespace lwo
