// Correctness of rings under random schedules, for every depth 1..8: random
// stage / acquire / release / misuse sequences over pinned and registered
// pools, every status and hit predicted, every byte read checked by checksum.
#include <thread>

#include "gpu/gpu_util.h"
#include "gpu/random_walk.h"

namespace lwo_test {
namespace {

class RingRandomWalk : public GpuTest, public ::testing::WithParamInterface<uint32_t> {};

TEST_P(RingRandomWalk, PinnedPool) {
  const uint32_t depth = GetParam();
  const uint64_t seed = test_seed(0xC0FFEE00u + depth);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (LWO_TEST_SEED varies it)");
  // More layers than slots, so that slots are reused; tensors of 3 bytes to
  // 3 MiB, 1..5 per layer, mixed dtypes; layer 1 is an empty record.
  const uint32_t n_layers = 9 + depth;
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(
      engine_, random_layer_specs(seed, n_layers, 3, uint64_t(3) << 20, 5), seed, &tp));

  WalkOptions opt;
  opt.depth = depth;
  opt.n_ops = 600;
  opt.n_streams = 2 + depth % 2;
  opt.seed = seed * 31 + 7;
  WalkResult r;
  ASSERT_NO_FATAL_FAILURE(random_walk(engine_, tp, opt, &r));
  uint64_t total = 0;
  for (const LayerRef& lr : tp.layers) total += lr.record_bytes;
  std::printf("[   walk   ] depth %u, %u layers, %.1f MiB, max record %.2f MiB: %s\n", depth,
              n_layers, total / 1048576.0, tp.max_record / 1048576.0, describe(r).c_str());
  EXPECT_GT(r.hits, 0u);
  EXPECT_GT(r.misses, 0u);
  EXPECT_GT(r.ring_full, 0u);
  EXPECT_GT(r.layer_busy, 0u);
  EXPECT_GT(r.checks, 100u);
  CHECK_LWO(tp.destroy());
}

INSTANTIATE_TEST_SUITE_P(Depth, RingRandomWalk, ::testing::Range(1u, 9u),
                         [](const ::testing::TestParamInfo<uint32_t>& p) {
                           return "depth" + std::to_string(p.param);
                         });

// Registered caller memory in mixed placements (contiguous layers, reversed
// and scattered tensors): slots checked tensor by tensor.
TEST_F(GpuTest, RingRandomWalkRegisteredMixed) {
  for (uint32_t depth : {1u, 3u, 6u}) {
    const uint64_t seed = test_seed(0xBEEF00u + depth);
    SCOPED_TRACE("depth " + std::to_string(depth) + ", seed " + std::to_string(seed));
    TestPool tp;
    ASSERT_NO_FATAL_FAILURE(create_registered_pool(
        engine_, random_layer_specs(seed, 10, 5, uint64_t(1) << 20, 4), seed, Placement::kMixed,
        &tp));
    WalkOptions opt;
    opt.depth = depth;
    opt.n_ops = 300;
    opt.n_streams = 3;
    opt.seed = seed + 1;
    WalkResult r;
    ASSERT_NO_FATAL_FAILURE(random_walk(engine_, tp, opt, &r));
    std::printf("[   walk   ] registered, depth %u: %s\n", depth, describe(r).c_str());
    EXPECT_GT(r.hits, 0u);
    EXPECT_GT(r.misses, 0u);
    CHECK_LWO(tp.destroy());
  }
}

// A ring deeper than the pool: nothing is ever evicted, so after the first
// copy of each layer every stage is a hit and the ring is never full.
TEST_F(GpuTest, RingRandomWalkDeeperThanPool) {
  const uint64_t seed = test_seed(0xD0D0u);
  SCOPED_TRACE("seed " + std::to_string(seed));
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(
      create_pinned_pool(engine_, random_layer_specs(seed, 4, 16, 256 << 10, 3), seed, &tp));
  WalkOptions opt;
  opt.depth = 8;
  opt.n_ops = 300;
  opt.seed = seed + 3;
  WalkResult r;
  ASSERT_NO_FATAL_FAILURE(random_walk(engine_, tp, opt, &r));
  EXPECT_EQ(0u, r.ring_full);
  EXPECT_LE(r.misses, 4u);
  EXPECT_GT(r.hits, 0u);
  CHECK_LWO(tp.destroy());
}

// Two threads, each walking its own ring over one shared pool (pools and
// rings serialise their own calls; both rings share the transfer stream).
TEST_F(GpuTest, RingRandomWalkTwoThreadsSharedPool) {
  const uint64_t seed = test_seed(0x7777u);
  SCOPED_TRACE("seed " + std::to_string(seed));
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(
      engine_, random_layer_specs(seed, 10, 8, uint64_t(1) << 20, 4), seed, &tp));
  WalkResult r[2];
  std::thread threads[2];
  for (int i = 0; i < 2; ++i) {
    threads[i] = std::thread([&, i] {
      WalkOptions opt;
      opt.depth = 2 + 3 * i;
      opt.n_ops = 300;
      opt.n_streams = 2;
      opt.seed = seed * 3 + i;
      random_walk(engine_, tp, opt, &r[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(r[i].checks, 50u) << "thread " << i;
    std::printf("[   walk   ] thread %d: %s\n", i, describe(r[i]).c_str());
  }
  CHECK_LWO(tp.destroy());
}

}  // namespace
}  // namespace lwo_test
