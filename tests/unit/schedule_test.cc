// Schedules: a whole pass is one loop of next() calls.
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using ScheduleTest = EngineTest;

// Runs a schedule to the end on `c`, reading each view, and returns the
// layers it produced.
std::vector<uint32_t> run_pass(EngineTest* t, RecordingBackend* gpu, lwo_pool* pool,
                               lwo_schedule* s, StreamH c) {
  std::vector<uint32_t> got;
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  lwo_status_t st;
  while ((st = lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v)) == LWO_OK) {
    got.push_back(v.layer);
    void* host = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(lwo_pool_layer_host(pool, v.layer, &host, &bytes), LWO_OK);
    EXPECT_EQ(bytes, v.record_bytes);
    EXPECT_EQ(std::memcmp(host, v.base, bytes), 0) << "layer " << v.layer;
    gpu->read(c, v.base, v.record_bytes);
  }
  EXPECT_EQ(st, LWO_END) << lwo_last_error_message();
  EXPECT_EQ(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v), LWO_END);  // stays ended
  (void)t;
  return got;
}

TEST_F(ScheduleTest, ForwardThenBackwardReusesResidentLayers) {
  const uint32_t L = 10;
  lwo_pool* pool = make_pool(L);
  for (uint32_t depth = 1; depth <= 8; ++depth) {
    lwo_ring* ring = make_ring(pool, depth);
    std::vector<uint32_t> order;
    for (uint32_t i = 0; i < L; ++i) order.push_back(i);
    for (uint32_t i = L; i-- > 0;) order.push_back(i);
    lwo_schedule* s = nullptr;
    ASSERT_LWO(lwo_schedule_create(ring, order.data(), static_cast<uint32_t>(order.size()), &s));
    StreamH c = gpu->new_stream();
    EXPECT_EQ(run_pass(this, gpu, pool, s, c), order);
    lwo_ring_stats st{};
    st.size = sizeof st;
    ASSERT_LWO(lwo_ring_get_stats(ring, &st));
    // Forward copies every layer; backward finds the last `depth` still in
    // slots (the first of them is the layer forward just used).
    EXPECT_EQ(st.n_stages, 2u * L) << "depth " << depth;
    EXPECT_EQ(st.n_hits, std::min(depth, L)) << "depth " << depth;
    uint32_t pos = 0;
    ASSERT_LWO(lwo_schedule_position(s, &pos));
    EXPECT_EQ(pos, order.size());
    ASSERT_LWO(lwo_schedule_destroy(s));
    lwo_ring_info info{};
    info.size = sizeof info;
    ASSERT_LWO(lwo_ring_get_info(ring, &info));
    EXPECT_EQ(info.n_free, depth);  // the schedule released everything
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  }
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(ScheduleTest, StagesDepthAheadWithoutBlocking) {
  lwo_pool* pool = make_pool(8);
  lwo_ring* ring = make_ring(pool, 3);
  uint32_t order[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 8, &s));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  uint64_t copies0 = gpu->stats.copies;
  ASSERT_LWO(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v));
  EXPECT_EQ(v.layer, 0u);
  EXPECT_EQ(gpu->stats.copies - copies0, 3u);  // layers 0, 1, 2 enqueued at once
  ASSERT_LWO(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v));
  EXPECT_EQ(gpu->stats.copies - copies0, 4u);  // one more as one is released
  ASSERT_LWO(lwo_schedule_reset(s, static_cast<lwo_stream_t>(c)));
  uint32_t pos = 9;
  ASSERT_LWO(lwo_schedule_position(s, &pos));
  EXPECT_EQ(pos, 0u);
  std::vector<uint32_t> got = run_pass(this, gpu, pool, s, c);
  EXPECT_EQ(got, std::vector<uint32_t>(order, order + 8));
  destroy(s, ring, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

TEST_F(ScheduleTest, RandomOrdersWithRepeatsAndCallerTickets) {
  const uint32_t L = 7;
  lwo_pool* pool = make_pool(L);
  std::mt19937 rng(99);
  for (int iter = 0; iter < 200; ++iter) {
    uint32_t depth = 1 + rng() % 8;
    lwo_ring* ring = make_ring(pool, depth + 1);
    // The caller holds one slot of its own the whole time.
    lwo_ticket mine{};
    uint32_t my_layer = rng() % L;
    ASSERT_LWO(lwo_ring_stage(ring, my_layer, &mine));
    std::vector<uint32_t> order(1 + rng() % 30);
    for (auto& x : order) {
      do x = rng() % L;
      while (x == my_layer);
    }
    lwo_schedule* s = nullptr;
    ASSERT_LWO(lwo_schedule_create(ring, order.data(), static_cast<uint32_t>(order.size()), &s));
    StreamH c = gpu->new_stream();
    EXPECT_EQ(run_pass(this, gpu, pool, s, c), order) << "iter " << iter;
    ASSERT_LWO(lwo_schedule_destroy(s));
    ASSERT_LWO(lwo_ring_release(ring, mine, static_cast<lwo_stream_t>(c)));
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_TRUE(gpu->violations.empty()) << "iter " << iter << ": " << gpu->violations[0];
  }
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(ScheduleTest, BadInputAndCurrentLayerHeldByCaller) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_schedule* s = nullptr;
  uint32_t bad[2] = {0, 3};
  EXPECT_EQ(lwo_schedule_create(ring, bad, 2, &s), LWO_ERR_OUT_OF_RANGE);
  EXPECT_NE(std::string(lwo_last_error_message()).find("entry 1 is layer 3"), std::string::npos);
  EXPECT_EQ(lwo_schedule_create(ring, bad, 0, &s), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_schedule_create(ring, nullptr, 2, &s), LWO_ERR_INVALID_ARGUMENT);
  uint32_t order[2] = {1, 2};
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  // The caller holds layer 1 itself: the schedule cannot take it, and says so.
  lwo_ticket t{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v), LWO_ERR_LAYER_BUSY);
  ASSERT_LWO(lwo_ring_release(ring, t, static_cast<lwo_stream_t>(c)));
  ASSERT_LWO(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), &v));  // works afterwards
  EXPECT_EQ(v.layer, 1u);
  EXPECT_EQ(lwo_schedule_next(s, static_cast<lwo_stream_t>(c), nullptr), LWO_ERR_INVALID_ARGUMENT);
  destroy(s, ring, pool);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
