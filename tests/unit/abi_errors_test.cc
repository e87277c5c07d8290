// Errors through the C ABI, on the recording backend: messages that start
// with the caller's call, the outputs of failed calls (handles NULL, tickets
// 0, other outputs left alone), argument errors before range errors.
#include "abi_fixture.h"

namespace lwo {
namespace testing {
namespace {

/* ---------------------------------------------------------------------- */
/* Messages and outputs of failed calls                                   */
/* ---------------------------------------------------------------------- */

using AbiErrors = AbiTest;

// Conventions: the message starts with the name of the call the caller
// made, also for a failure deep inside it (lwo_schedule_next staging a
// layer names lwo_schedule_next, then the position and layer, then the
// staging error); the schedule's position does not advance.
TEST_F(AbiErrors, MessagesStartWithTheCallersCall) {
  auto [pool, ring, c] = pool_ring_stream(3, 1);
  lwo_ticket held{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &held));
  uint32_t order[2] = {1, 2};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(s, stream(c), &v), LWO_ERR_LAYER_BUSY);
  std::string m = msg();
  EXPECT_TRUE(starts_with(m, "lwo_schedule_next: ")) << m;
  EXPECT_FALSE(contains(m, "lwo_ring_stage")) << m;
  size_t at_pos = m.find("position 0");
  size_t at_layer = m.find("layer 1");
  size_t at_err = m.find("already staged");
  EXPECT_NE(at_pos, std::string::npos) << m;
  EXPECT_NE(at_layer, std::string::npos) << m;
  EXPECT_NE(at_err, std::string::npos) << m;
  EXPECT_LT(at_pos, at_err) << m;
  uint32_t pos = 9;
  ASSERT_LWO(lwo_schedule_position(s, &pos));
  EXPECT_EQ(pos, 0u);
  ASSERT_LWO(lwo_ring_release(ring, held, stream(c)));
  ASSERT_LWO(lwo_schedule_next(s, stream(c), &v));  // the retry works
  EXPECT_EQ(v.layer, 1u);
  EXPECT_EQ(msg(), "");
  ASSERT_LWO(lwo_schedule_destroy(s));

  std::vector<uint8_t> w(10);
  EXPECT_EQ(lwo_pool_write(pool, 1, "weight", w.data(), w.size()), LWO_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_write: ")) << msg();
  EXPECT_TRUE(contains(msg(), "given 10")) << msg();
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(ring, 7, &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_stage: ")) << msg();
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  EXPECT_EQ(lwo_grads_end(g, 0, stream(c)), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_end: ")) << msg();
  destroy(g, ring, pool);
}

// Conventions: a failed call sets an output handle to NULL, also when the
// failure is the input handle itself or an argument checked after it.
TEST_F(AbiErrors, FailedCreatesSetTheirHandleToNull) {
  ModelDesc m(2);
  lwo_pool* pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(nullptr, m.layers.data(), 2, nullptr, &pool),
            LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 2, nullptr, 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(pool, nullptr);
  pool = make_pool(2);
  lwo_ring* ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(nullptr, nullptr, &ring), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(ring, nullptr);
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  rc.depth = 0;
  ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(pool, &rc, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ring, nullptr);
  gpu->fail_alloc_after = 0;
  ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(pool, nullptr, &ring), LWO_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(ring, nullptr);
  lwo_grads* g = bogus<lwo_grads>();
  uint8_t none[2] = {0, 0};
  EXPECT_EQ(lwo_grads_create(pool, none, nullptr, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g, nullptr);
  ring = make_ring(pool, 1);
  lwo_schedule* s = bogus<lwo_schedule>();
  uint32_t order[1] = {5};
  EXPECT_EQ(lwo_schedule_create(ring, order, 1, &s), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(s, nullptr);
  s = bogus<lwo_schedule>();
  EXPECT_EQ(lwo_schedule_create(nullptr, order, 1, &s), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(s, nullptr);
  lwo_checkpoint* ck = bogus<lwo_checkpoint>();
  EXPECT_EQ(lwo_checkpoint_open("/nonexistent/lwo_abi.safetensors", &ck), LWO_ERR_IO);
  EXPECT_EQ(ck, nullptr);
  ck = bogus<lwo_checkpoint>();
  EXPECT_EQ(lwo_checkpoint_open(nullptr, &ck), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ck, nullptr);
  destroy(ring, pool);
}

// Conventions: a failed lwo_ring_stage sets the output ticket to {0}, for
// every failure once the ticket pointer is known to be valid (a non-NULL
// pointer is valid whatever the ring handle is).
TEST_F(AbiErrors, FailedStageSetsTheTicketToZero) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ticket held{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &held));
  lwo_ticket t{0xdeadbeef};
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_LAYER_BUSY);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_RING_FULL);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(ring, 3, &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(nullptr, 1, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(t.id, 0u) << "the ticket pointer was valid; only the ring handle was not";
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(reinterpret_cast<lwo_ring*>(pool), 1, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(t.id, 0u);
  ASSERT_LWO(lwo_ring_release(ring, held, nullptr));
  destroy(ring, pool);
}

// Conventions: checks run in order: handles, then NULL pointers, structs and
// other arguments, then ranges and names. A call given both a bad argument
// and a bad layer / index reports the argument.
TEST_F(AbiErrors, ArgumentErrorsComeBeforeRangeErrors) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  // Handles first.
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(nullptr, 99, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_pool_write_range(nullptr, 99, nullptr, 0, nullptr, 4), LWO_ERR_INVALID_HANDLE);
  // Then arguments, before the range of the layer.
  EXPECT_EQ(lwo_ring_stage(ring, 99, nullptr), LWO_ERR_INVALID_ARGUMENT);
  lwo_layer_view small = LWO_LAYER_VIEW_INIT;
  small.size = 0;
  EXPECT_EQ(lwo_grads_begin(g, 99, nullptr, &small), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_pool_shard_tensor(pool, 99, "weight", nullptr, nullptr, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ti.size = 0;
  EXPECT_EQ(lwo_pool_tensor_info(pool, 99, 0, &ti), LWO_ERR_INVALID_ARGUMENT)
      << "an info struct of size 0 is an argument error, checked before the layer: " << msg();
  EXPECT_EQ(lwo_pool_write_range(pool, 99, "weight", 0, nullptr, 4), LWO_ERR_INVALID_ARGUMENT)
      << "src NULL with 4 bytes is an argument error, checked before the layer: " << msg();
  destroy(g, ring, pool);
}

// Conventions: every output other than handles and tickets is left as it
// was by a failed call.
TEST_F(AbiErrors, OtherOutputsOfFailedCallsAreLeftAlone) {
  lwo_pool* pool = make_pool(2);
  void* d = bogus<void>();
  uint64_t first = 99, n = 99, off = 99;
  EXPECT_EQ(lwo_pool_shard_tensor(pool, 1, "nope", &d, &first, &n), LWO_ERR_NOT_FOUND);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_shard_tensor: ")) << msg();
  EXPECT_EQ(d, bogus<void>());
  EXPECT_EQ(first, 99u);
  EXPECT_EQ(n, 99u);
  EXPECT_EQ(lwo_pool_shard_host(pool, 2, &d, &off, &n), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_shard_host: ")) << msg();
  EXPECT_EQ(d, bogus<void>());
  EXPECT_EQ(off, 99u);
  EXPECT_EQ(n, 99u);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  float* gd = reinterpret_cast<float*>(uintptr_t{0x1234});
  EXPECT_EQ(lwo_grads_shard(g, 0, "bias", &gd, &first, &n), LWO_ERR_NOT_FOUND);  // even layers have none
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_shard: ")) << msg();
  EXPECT_EQ(gd, reinterpret_cast<float*>(uintptr_t{0x1234}));
  EXPECT_EQ(first, 99u);
  EXPECT_EQ(n, 99u);
  destroy(g, pool);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
