// Sharded pools on the recording backend (a communicator of one rank): the
// shard copy, the all-gather into the slot and the ready event after it.
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using ShardedTest = EngineTest;

TEST_F(ShardedTest, ShardCopyThenGatherThenReady) {
  ModelDesc m(4);
  int fake_comm = 0;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 4,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  // Fill through lwo_pool_write (whole tensors) and check through the shard.
  std::vector<std::vector<uint8_t>> w(4);
  for (uint32_t l = 0; l < 4; ++l) {
    uint64_t rows = (l % 5 + 1) * 37;
    w[l].resize(rows * 19 * 2);
    fill_random(w[l].data(), w[l].size(), 100 + l);
    ASSERT_LWO(lwo_pool_write(pool, l, "weight", w[l].data(), w[l].size()));
    void* shard = nullptr;
    uint64_t off = 9, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    EXPECT_EQ(off, 0u);  // rank 0 of 1
    uint64_t rb = 0;
    ASSERT_LWO(lwo_pool_record_bytes(pool, l, &rb));
    EXPECT_EQ(bytes, rb);
    EXPECT_EQ(std::memcmp(shard, w[l].data(), w[l].size()), 0);
  }
  void* host = nullptr;
  EXPECT_EQ(lwo_pool_layer_host(pool, 0, &host, nullptr), LWO_ERR_UNSUPPORTED);
  EXPECT_EQ(lwo_pool_tensor_host(pool, 0, "weight", &host, nullptr), LWO_ERR_UNSUPPORTED);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  uint64_t gathers = gpu->stats.gathers;
  for (int pass = 0; pass < 3; ++pass)
    for (uint32_t l = 0; l < 4; ++l) {
      lwo_ticket t{};
      lwo_layer_view v{};
      ASSERT_LWO(lwo_ring_stage(ring, l, &t));
      ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
      EXPECT_EQ(std::memcmp(v.tensors[0], w[l].data(), w[l].size()), 0) << "layer " << l;
      gpu->read(c, v.base, v.record_bytes);  // must follow the gather, not only the copy
      ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    }
  EXPECT_EQ(gpu->stats.gathers - gathers, 12u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  lwo_pool* p2 = nullptr;
  EXPECT_EQ(lwo_pool_create_sharded(engine, m.layers.data(), 4, nullptr, nullptr, &p2),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_pool_create_sharded"), std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
