// Checking mode (LWO_ENGINE_CHECKING) on the recording backend: a released
// ring slot and an ended gradient slot hold the pattern, in stream order
// after their last reader and before the next writer; host gradients hold it
// until their gradient lands or the fence zeroes them; off, nothing is filled.
#include <cmath>
#include <cstdlib>

#include "engine/engine.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class CheckingTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    engine_set_checking(engine, true);
  }
  static bool all_pattern(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i)
      if (b[i] != LWO_CHECKING_BYTE) return false;
    return n > 0;
  }
  lwo_grads* make_grads(lwo_pool* pool, uint32_t flags) {
    lwo_grads_config c = LWO_GRADS_CONFIG_INIT;
    c.flags = flags;
    lwo_grads* g = nullptr;
    EXPECT_EQ(lwo_grads_create(pool, nullptr, &c, &g), LWO_OK) << lwo_last_error_message();
    return g;
  }
  // Writes 0.5f into every f32 element of the layer's staging view.
  void write_halves(StreamH s, const lwo_layer_view& v) {
    for (uint32_t k = 0; k < v.n_tensors; ++k) {
      gpu->write(s, v.tensors[k], v.tensor_bytes[k]);
      float* f = static_cast<float*>(v.tensors[k]);
      for (uint64_t i = 0; i < v.tensor_bytes[k] / 4; ++i) f[i] = 0.5f;
    }
  }
  // The layer's host gradients: every f32 element equals `want`, or (want
  // NaN) holds the pattern.
  void expect_host(lwo_grads* g, lwo_pool* pool, uint32_t layer, float want, const char* what) {
    for (const lwo_tensor_info& ti : layer_tensors(pool, layer)) {
      float* h = nullptr;
      uint64_t n = 0, first = 0;
      ASSERT_LWO(lwo_grads_shard(g, layer, ti.name, &h, &first, &n));
      ASSERT_GT(n, 0u);
      if (std::isnan(want)) {
        EXPECT_TRUE(all_pattern(h, n * 4)) << what << ": layer " << layer << " " << ti.name;
      } else {
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_EQ(h[i], want) << what << ": layer " << layer << " " << ti.name << " i " << i;
      }
    }
  }
};

TEST_F(CheckingTest, ReleasedSlotHoldsThePatternAndIsFilledAgain) {
  auto [pool, ring, c] = pool_ring_stream(3, 2);
  for (int round = 0; round < 2; ++round)
    for (uint32_t l = 0; l < 3; ++l) {
      lwo_ticket t{0};
      ASSERT_LWO(lwo_ring_stage(ring, l, &t));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
      EXPECT_TRUE(holds_layer(pool, v)) << "round " << round << " layer " << l;
      gpu->read(c, v.base, v.record_bytes);
      ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
      // The release filled the record with the pattern on the release stream.
      EXPECT_TRUE(all_pattern(v.base, v.record_bytes)) << "layer " << l;
      lwo_ticket_state_t st{};
      ASSERT_LWO(lwo_ring_ticket_state(ring, t, &st));
      EXPECT_EQ(LWO_TICKET_ENDED, st);
    }
  // Staging a layer again right after its release is a copy, not a hit.
  lwo_ticket t{0};
  ASSERT_LWO(lwo_ring_stage(ring, 2, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
  EXPECT_TRUE(holds_layer(pool, v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  lwo_ring_stats rs{};
  rs.size = sizeof rs;
  ASSERT_LWO(lwo_ring_get_stats(ring, &rs));
  EXPECT_EQ(0u, rs.n_hits);
  EXPECT_EQ(7u, gpu->stats.fills);
  lwo_ring_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_ring_get_info(ring, &info));
  EXPECT_EQ(2u, info.n_free);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(CheckingTest, UnacquiredReleaseFillsAfterTheCopy) {
  // A staged ticket released on a stream that never waited for the copy:
  // the fill is ordered after the copy (no write-write race), and a read on
  // another stream that is not joined into the release stream is caught.
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream(), other = gpu->new_stream();
  lwo_ticket t{0};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(other), &v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(other)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));  // never acquired
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  EXPECT_TRUE(all_pattern(v.base, 64));
  gpu->read(other, v.base, 64);  // `other` never waited for the fill
  EXPECT_FALSE(gpu->violations.empty()) << "an unordered read of a released slot";
  gpu->violations.clear();
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(CheckingTest, ResidentLayerIsUploadedAgainAfterItsRelease) {
  lwo_pool* pool = make_pool(3);
  const uint32_t resident[] = {1};
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  rc.depth = 1;
  rc.resident_layers = resident;
  rc.n_resident = 1;
  lwo_ring* ring = nullptr;
  ASSERT_LWO(lwo_ring_create(pool, &rc, &ring));
  StreamH c = gpu->new_stream();
  for (int round = 0; round < 3; ++round) {
    lwo_ticket t{0};
    ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
    EXPECT_TRUE(holds_layer(pool, v)) << "round " << round;
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    EXPECT_TRUE(all_pattern(v.base, v.record_bytes));
  }
  lwo_ring_stats rs{};
  rs.size = sizeof rs;
  ASSERT_LWO(lwo_ring_get_stats(ring, &rs));
  EXPECT_EQ(1u, rs.n_resident_hits);     // the first stage, after the upload at creation
  EXPECT_EQ(3u, rs.n_resident_uploads);  // creation, then after each release but the last
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(CheckingTest, GradientsHoldThePatternUntilTheyLand) {
  lwo_pool* pool = make_pool(3);
  lwo_grads* g = make_grads(pool, LWO_GRADS_F32);
  StreamH c = gpu->new_stream();
  // Created: every layer holds the pattern, not zeros.
  for (uint32_t l = 0; l < 3; ++l) expect_host(g, pool, l, NAN, "created");
  for (int micro = 0; micro < 2; ++micro)
    for (uint32_t l = 0; l < 2; ++l) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
      // A used staging slot holds its last end's pattern, not an old gradient.
      if (micro > 0) {
        EXPECT_TRUE(all_pattern(v.base, v.record_bytes)) << "begin of layer " << l;
      }
      write_halves(c, v);
      ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
      EXPECT_TRUE(all_pattern(v.base, v.record_bytes)) << "end of layer " << l;
    }
  // Layer 2 got no gradient: still the pattern before the fence, zeros after.
  expect_host(g, pool, 2, NAN, "before the fence");
  ASSERT_LWO(lwo_grads_wait(g));
  expect_host(g, pool, 0, 1.0f, "after the fence");
  expect_host(g, pool, 1, 1.0f, "after the fence");
  expect_host(g, pool, 2, 0.0f, "after the fence");
  // Zero: the old sums are gone at once.
  ASSERT_LWO(lwo_grads_zero(g));
  for (uint32_t l = 0; l < 2; ++l) expect_host(g, pool, l, NAN, "zeroed");
  expect_host(g, pool, 2, 0.0f, "zeroed with no gradient since");
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
  write_halves(c, v);
  ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  expect_host(g, pool, 0, 0.0f, "after the second fence");
  expect_host(g, pool, 1, 0.5f, "after the second fence");
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(EngineTest, CheckingOffFillsNothing) {
  engine_set_checking(engine, false);  // whatever LWO_CHECKING says
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 3; ++l) {
    lwo_ticket t{0};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    EXPECT_TRUE(holds_layer(pool, v)) << "the released slot still holds layer " << l;
    lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &gv));
    gpu->write(c, gv.base, gv.record_bytes);
    ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
  }
  ASSERT_LWO(lwo_grads_wait(g));
  ASSERT_LWO(lwo_grads_zero(g));
  EXPECT_EQ(0u, gpu->stats.fills);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST(CheckingFlag, TheEngineFlagAndTheEnvironmentTurnItOn) {
  // The flag is accepted by lwo_engine_create's check (the device call
  // after it may fail here: no GPU), and the environment is read at
  // creation.
  lwo_engine_config cfg = LWO_ENGINE_CONFIG_INIT;
  cfg.flags = LWO_ENGINE_CHECKING | 0x80000000u;
  lwo_engine* e = nullptr;
  EXPECT_EQ(LWO_ERR_INVALID_ARGUMENT, lwo_engine_create(&cfg, &e));
  cfg.flags = LWO_ENGINE_CHECKING;
  lwo_status_t s = lwo_engine_create(&cfg, &e);
  EXPECT_NE(LWO_ERR_INVALID_ARGUMENT, s) << lwo_last_error_message();
  if (s == LWO_OK) {
    EXPECT_EQ(LWO_OK, lwo_engine_destroy(e));
  }
  ASSERT_EQ(0, setenv("LWO_CHECKING", "1", 1));
  {
    Engine on(std::make_unique<RecordingBackend>(), 0);
    EXPECT_TRUE(on.checking());
  }
  ASSERT_EQ(0, setenv("LWO_CHECKING", "0", 1));
  {
    Engine off(std::make_unique<RecordingBackend>(), 0);
    EXPECT_FALSE(off.checking());
  }
  ASSERT_EQ(0, unsetenv("LWO_CHECKING"));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
