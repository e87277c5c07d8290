// The host backend behind the test export lwo_test_engine_create_host
// (bindings/c/lwo_test.h): the real engine on host memory, its poison of
// released ring slots, and layer compute on the CPU.
#include <cmath>

#include "bindings/c/lwo_test.h"
#include "src/common/dtype.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class HostEngine : public EngineTest {
 protected:
  void SetUp() override {}  // the engine is the test's: lwo_test_engine_create_host
  void make(uint32_t flags) { ASSERT_LWO(lwo_test_engine_create_host(flags, &engine)); }
};

TEST_F(HostEngine, RefusesUnknownFlagsAndNoOutput) {
  lwo_engine* e = reinterpret_cast<lwo_engine*>(this);
  EXPECT_EQ(lwo_test_engine_create_host(0x8, &e), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(e, nullptr);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_test_engine_create_host"), std::string::npos) << m;
  EXPECT_EQ(lwo_test_engine_create_host(0, nullptr), LWO_ERR_INVALID_ARGUMENT);
}

TEST_F(HostEngine, AReleasedSlotReadsAsPoisonUntilAcquiredOrFilledAgain) {
  make(LWO_TEST_HOST_POISON);
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  auto stage_acquire = [&](uint32_t layer, lwo_layer_view* v) {
    lwo_ticket t{};
    EXPECT_EQ(lwo_ring_stage(ring, layer, &t), LWO_OK) << lwo_last_error_message();
    EXPECT_EQ(lwo_ring_acquire(ring, t, nullptr, v), LWO_OK) << lwo_last_error_message();
    return t;
  };
  auto poisoned = [](const lwo_layer_view& v) {
    const auto* b = static_cast<const uint8_t*>(v.base);
    for (uint64_t i = 0; i < v.record_bytes; ++i)
      if (b[i] != 0xff) return false;
    return true;
  };
  lwo_layer_view v0 = LWO_LAYER_VIEW_INIT, v1 = LWO_LAYER_VIEW_INIT, v2 = LWO_LAYER_VIEW_INIT,
                 again = LWO_LAYER_VIEW_INIT;
  lwo_ticket t = stage_acquire(0, &v0);
  EXPECT_TRUE(holds_layer(pool, v0));
  ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  EXPECT_TRUE(poisoned(v0));  // a reader after the release sees NaN
  t = stage_acquire(0, &again);  // a hit: the bytes are back
  EXPECT_EQ(again.base, v0.base);
  EXPECT_TRUE(holds_layer(pool, again));
  ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  lwo_ticket t1{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t1));  // a hit staged, released unacquired
  ASSERT_LWO(lwo_ring_release(ring, t1, nullptr));
  t1 = stage_acquire(1, &v1);
  EXPECT_TRUE(holds_layer(pool, v1));
  ASSERT_LWO(lwo_ring_release(ring, t1, nullptr));
  t = stage_acquire(2, &v2);  // fills the slot of layer 0, released longest ago
  EXPECT_EQ(v2.base, v0.base);
  EXPECT_TRUE(holds_layer(pool, v2));
  ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_OK);
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_OK);
}

TEST_F(HostEngine, WithoutPoisonAReleasedSlotKeepsItsBytes) {
  make(0);
  lwo_pool* pool = make_pool(1);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
  ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  EXPECT_TRUE(holds_layer(pool, v));
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_OK);
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_OK);
}

// y = x W^T + b and its backward on the CPU, in bf16 with f32 gradients
// accumulated: every output the f32 sum rounded once.
TEST_F(HostEngine, LinearRunsOnTheCpuRoundedOnce) {
  make(LWO_TEST_HOST_POISON);
  const int64_t T = 3, in = 5, out = 4;
  std::vector<uint16_t> x(T * in), w(out * in), b(out), y(T * out), dy(T * out), dx(T * in);
  std::vector<float> xf(T * in), wf(out * in), bf(out), dyf(T * out);
  auto fill = [](std::vector<uint16_t>& h, std::vector<float>& f, float scale) {
    for (size_t i = 0; i < h.size(); ++i) {
      h[i] = f32_to_bf16(scale * std::sin(1.7f * float(i) + scale));
      f[i] = bf16_to_f32(h[i]);
    }
  };
  fill(x, xf, 1.0f);
  fill(w, wf, 0.5f);
  fill(b, bf, 0.25f);
  fill(dy, dyf, 2.0f);
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.in_features = in;
  d.out_features = out;
  d.dtype = LWO_DTYPE_BF16;
  d.flags = LWO_LINEAR_BIAS | LWO_LINEAR_ACCUMULATE;
  ASSERT_LWO(lwo_linear_forward(engine, &d, T, x.data(), w.data(), b.data(), y.data(), nullptr));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      float s = 0.0f;
      for (int64_t i = 0; i < in; ++i) s += xf[t * in + i] * wf[o * in + i];
      EXPECT_EQ(y[t * out + o], f32_to_bf16(s + bf[o])) << t << "," << o;
    }
  std::vector<float> dw(out * in, 1.0f), db(out, -1.0f);
  ASSERT_LWO(lwo_linear_backward(engine, &d, T, x.data(), dy.data(), w.data(), dx.data(),
                                 dw.data(), db.data(), LWO_DTYPE_F32, nullptr));
  for (int64_t o = 0; o < out; ++o) {
    float sb = 0.0f;
    for (int64_t t = 0; t < T; ++t) sb += dyf[t * out + o];
    EXPECT_EQ(db[o], -1.0f + sb);
    for (int64_t i = 0; i < in; ++i) {
      float s = 0.0f;
      for (int64_t t = 0; t < T; ++t) s += dyf[t * out + o] * xf[t * in + i];
      EXPECT_EQ(dw[o * in + i], 1.0f + s);
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < in; ++i) {
      float s = 0.0f;
      for (int64_t o = 0; o < out; ++o) s += dyf[t * out + o] * wf[o * in + i];
      EXPECT_EQ(dx[t * in + i], f32_to_bf16(s));
    }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
