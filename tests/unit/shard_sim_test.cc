// The sharded-step simulator (src/plan/shard_sim.h) against the figures
// recorded in docs/PERFORMANCE.md ("Sharded streaming on two GPUs"), each
// with the rates measured in the same run, and its rules on made-up cases.
#include "src/plan/shard_sim.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace lwo {
namespace plan {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

// A forward stream of 32 records of `record` bytes with nothing computed:
// the effective streaming bandwidth per GPU, the bench's figure of merit.
double stream_gbps(uint32_t ranks, uint64_t record, double link_each, uint32_t depth = 2) {
  ShardRates r;
  r.link_gbps = link_each;
  r.host_gbps = link_each * ranks;  // "links together": what the host gave both links
  ShardStep s;
  s.gpus_per_node = ranks;
  s.n_layers = 32;
  s.record_bytes = record;
  s.train = false;
  s.depth = depth;
  return simulate_shard_step(s, r).per_gpu_gbps;
}

struct Recorded {
  const char* what;
  uint32_t ranks;
  uint64_t record;
  double link_each;  // the run's per-link peak, all links copying at once
  double measured;   // GB/s per GPU
  uint32_t depth;
};

TEST(ShardSim, ForwardStreamingWithin5PercentOfTheRecordedRuns) {
  const Recorded runs[] = {
      {"run A, 1 rank, 128 MiB", 1, 128 * kMiB, 53.6, 53.6, 2},
      {"run A, 1 rank, 64 MiB", 1, 64 * kMiB, 54.9, 54.9, 2},
      {"run A, 2 ranks, 64 MiB", 2, 64 * kMiB, 50.1, 98.9, 2},
      {"device-test, 2 ranks, 128 MiB", 2, 128 * kMiB, 101.3 / 2, 99.3, 2},
      {"scripts/scale, 2 ranks, 128 MiB", 2, 128 * kMiB, 102.7 / 2, 104.4, 2},
      {"third lease, 2 ranks, 128 MiB", 2, 128 * kMiB, 54.95, 110.0, 2},
      {"run B, 128 MiB, depth 2", 2, 128 * kMiB, 54.0, 105.9, 2},
      {"run B, 128 MiB, depth 3", 2, 128 * kMiB, 54.0, 107.1, 3},
      {"run B, 128 MiB, depth 4", 2, 128 * kMiB, 52.9, 107.0, 4},
      {"run B, 64 MiB, depth 2", 2, 64 * kMiB, 53.2, 108.8, 2},
      {"run B, 64 MiB, depth 3", 2, 64 * kMiB, 54.5, 107.7, 3},
      {"run B, 64 MiB, depth 4", 2, 64 * kMiB, 54.4, 108.2, 4},
  };
  for (const Recorded& r : runs) {
    double p = stream_gbps(r.ranks, r.record, r.link_each, r.depth);
    EXPECT_NEAR(p / r.measured, 1.0, 0.05) << r.what << ": predicted " << p << " GB/s, measured "
                                           << r.measured;
  }
}

// Run A's other two-rank rows came in at 93% to 95% of what both links
// measured (the ranks' jitter coupled through the all-gather, which the
// simulator does not model): the prediction is the bound, 5% to 8% above.
TEST(ShardSim, RunAsCoupledRowsAreAboveTheMeasurementByUnder8Percent) {
  const Recorded runs[] = {
      {"128 MiB", 2, 128 * kMiB, 52.7, 97.9, 2},
      {"32 MiB", 2, 32 * kMiB, 53.1, 100.7, 2},
      {"16 MiB", 2, 16 * kMiB, 54.2, 102.0, 2},
      {"8 MiB", 2, 8 * kMiB, 52.7, 99.2, 2},
  };
  for (const Recorded& r : runs) {
    double ratio = stream_gbps(r.ranks, r.record, r.link_each) / r.measured;
    EXPECT_GT(ratio, 1.0) << r.what;
    EXPECT_LT(ratio, 1.08) << r.what;
  }
}

// The training step of 32 x Linear(8192x8192) bf16, T=8192 per rank, f32
// gradients (scripts/scale, run A's lease): resident compute 150.6 ms
// (a third forward, two thirds backward), the links' peaks of that run.
ShardStep training(uint32_t ranks) {
  ShardStep s;
  s.gpus_per_node = ranks;
  s.n_layers = 32;
  s.record_bytes = 8192ull * 8192 * 2;
  s.grad_bytes = 8192ull * 8192 * 4;
  s.fwd_ms = 150.6 / 32 / 3;
  s.bwd_ms = 150.6 / 32 * 2 / 3;
  return s;
}

ShardRates run_a_rates() {
  ShardRates r;
  r.link_gbps = 54.0;
  r.duplex_h2d_gbps = 54.0;  // "H2D at peak" and "D2H at peak" of the run
  r.duplex_d2h_gbps = 55.3;
  return r;
}

TEST(ShardSim, TrainingStepsWithin5PercentOfTheRecordedRuns) {
  ShardPrediction one = simulate_shard_step(training(1), run_a_rates());
  EXPECT_NEAR(one.step_ms / 238.8, 1.0, 0.05) << one.step_ms;  // scripts/scale
  EXPECT_NEAR(one.step_ms / 248.6, 1.0, 0.05) << one.step_ms;  // scripts/device-test
  ShardPrediction two = simulate_shard_step(training(2), run_a_rates());
  EXPECT_NEAR(two.step_ms / 174.7, 1.0, 0.05) << two.step_ms;
  EXPECT_NEAR(two.step_ms / 175.1, 1.0, 0.05) << two.step_ms;
  EXPECT_NEAR(two.collective_ms / 34.3, 1.0, 0.05) << two.collective_ms;
  // One rank: the f32 gradients down one link bound the backward pass.
  EXPECT_NEAR(one.d2h_ms / 155.4, 1.0, 0.05) << one.d2h_ms;
  // The turn from forward to backward finds the ring's last layers: hits.
  EXPECT_EQ(one.copies, 2u * 32 - 2);
}

TEST(ShardSim, MoreNodesSplitNothingMoreButAddTheirAllReduce) {
  ShardRates r;
  r.host_gbps = 400.0;
  ShardStep s = training(8);
  ShardPrediction one_node = simulate_shard_step(s, r);
  s.nodes = 4;
  ShardPrediction four = simulate_shard_step(s, r);
  EXPECT_GT(four.collective_ms, one_node.collective_ms);
  EXPECT_GE(four.step_ms, one_node.step_ms);
  // Each rank's copies are 1/8 of a record whatever the number of nodes.
  EXPECT_DOUBLE_EQ(four.h2d_ms, one_node.h2d_ms);
  // A slower network makes the step slower.
  r.inter_node_gbps = 5.0;
  EXPECT_GT(simulate_shard_step(s, r).step_ms, four.step_ms);
}

TEST(ShardSim, TheHostSharesItsBandwidthAmongTheRanksOfANode) {
  // 8 ranks behind a host of 100 GB/s: 12.5 GB/s each, not the link's 54.
  double p = stream_gbps(1, 64 * kMiB, 54.0);
  ShardRates r;
  r.host_gbps = 100.0;
  ShardStep s;
  s.gpus_per_node = 8;
  s.record_bytes = 64 * kMiB;
  s.train = false;
  double eight = simulate_shard_step(s, r).per_gpu_gbps;
  EXPECT_LT(eight, 100.0 * 1.001);
  EXPECT_GT(eight, p);
}

TEST(ShardSim, RefusesNonsense) {
  ShardRates r;
  ShardStep s;
  EXPECT_THROW(simulate_shard_step(s, r), std::invalid_argument);  // no record bytes
  s.record_bytes = kMiB;
  s.gpus_per_node = 0;
  EXPECT_THROW(simulate_shard_step(s, r), std::invalid_argument);
  s.gpus_per_node = 1;
  r.inter_node_gbps = 0.0;
  EXPECT_THROW(simulate_shard_step(s, r), std::invalid_argument);
  r.inter_node_gbps = 50.0;
  r.collective_compute_cost = -1.0;
  EXPECT_THROW(simulate_shard_step(s, r), std::invalid_argument);
}

}  // namespace
}  // namespace plan
}  // namespace lwo
