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

// A sharded pool of one rank over the host backend's one-rank communicator
// (what lwo.torch's process_group= path streams through without a GPU): a
// stage gives the whole record (the all-gather of one rank), the gradients
// of every layer reach the shard's f32 buffer (the reduction of one rank),
// and an AdamW step from them writes the same bytes as over a pinned pool.
TEST_F(HostEngine, AShardedPoolOfOneRankStreamsSumsAndSteps) {
  make(LWO_TEST_HOST_POISON);
  const uint32_t L = 3;
  ModelDesc m(L);
  lwo_nccl_unique_id id;
  ASSERT_LWO(lwo_nccl_get_unique_id(&id));
  lwo_nccl_comm_t comm = nullptr;
  ASSERT_LWO(lwo_nccl_comm_create(engine, &id, 1, 0, &comm));
  lwo_pool* pools[2] = {nullptr, nullptr};
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), L, comm, nullptr, &pools[0]));
  ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), L, nullptr, &pools[1]));
  lwo_pool_info info = LWO_POOL_INFO_INIT;
  ASSERT_LWO(lwo_pool_get_info(pools[0], &info));
  EXPECT_EQ(info.kind, LWO_POOL_SHARDED);
  EXPECT_EQ(info.n_ranks, 1);
  auto value = [](uint32_t l, uint32_t k, uint64_t i, float scale) {
    return scale * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(l * 7 + k));
  };
  lwo_grads* grads[2] = {nullptr, nullptr};
  lwo_optim* optims[2] = {nullptr, nullptr};
  for (int which = 0; which < 2; ++which) {
    lwo_pool* pool = pools[which];
    for (uint32_t l = 0; l < L; ++l)
      for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        std::vector<uint8_t> b(ti.bytes);
        for (uint64_t i = 0; i < ti.bytes / lwo_dtype_size(ti.dtype); ++i)
          store_f32(b.data(), ti.dtype, i, value(l, k, i, 0.5f));
        ASSERT_LWO(lwo_pool_write(pool, l, ti.name, b.data(), b.size()));
      }
    lwo_ring* ring = make_ring(pool, 2);
    for (uint32_t l = 0; l < L; ++l) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_ring_stage(ring, l, &t));
      ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
      EXPECT_TRUE(holds_layer(pool, v)) << "pool " << which << " layer " << l;
      ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
    }
    ASSERT_LWO(lwo_ring_destroy(ring));
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = which ? LWO_GRADS_F32 : 0;  // a sharded pool's are f32 anyway
    ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads[which]));
    for (uint32_t l = L; l-- > 0;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(grads[which], l, nullptr, &v));
      for (uint32_t k = 0; k < v.n_tensors; ++k) {
        ASSERT_EQ(v.tensor_dtypes[k], LWO_DTYPE_F32);
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        for (uint64_t i = 0; i < ti.bytes / lwo_dtype_size(ti.dtype); ++i)
          static_cast<float*>(v.tensors[k])[i] = value(l, k, i, 2.0f);
      }
      ASSERT_LWO(lwo_grads_end(grads[which], l, nullptr));
    }
    ASSERT_LWO(lwo_grads_wait(grads[which]));
    for (uint32_t l = 0; l < L; ++l)
      for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        float* g = nullptr;
        uint64_t first = 9, n = 0;
        ASSERT_LWO(lwo_grads_shard(grads[which], l, ti.name, &g, &first, &n));
        ASSERT_EQ(first, 0u);
        ASSERT_EQ(n, ti.bytes / lwo_dtype_size(ti.dtype));
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_EQ(g[i], value(l, k, i, 2.0f)) << "pool " << which << " layer " << l;
      }
    lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
    ASSERT_LWO(lwo_optim_create(grads[which], &oc, &optims[which]));
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    p.step = 1;
    p.lr = 1e-2;
    p.weight_decay = 0.1;
    ASSERT_LWO(lwo_optim_step(optims[which], &p));
    ASSERT_LWO(lwo_optim_wait(optims[which]));
  }
  for (uint32_t l = 0; l < L; ++l) {
    void* a = nullptr;
    void* b = nullptr;
    uint64_t na = 0, nb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pools[0], l, &a, &na));
    ASSERT_LWO(lwo_pool_layer_host(pools[1], l, &b, &nb));
    ASSERT_EQ(na, nb);
    EXPECT_EQ(std::memcmp(a, b, na), 0) << "layer " << l;
    // and the step moved them: each weight by about lr
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    ASSERT_LWO(lwo_pool_tensor_info(pools[0], l, 0, &ti));
    const float w1 = load_f32(static_cast<uint8_t*>(a) + ti.offset, ti.dtype, 1);
    EXPECT_GT(std::fabs(w1 - value(l, 0, 1, 0.5f)), 5e-3f) << "layer " << l;
  }
  for (int which = 0; which < 2; ++which) {
    ASSERT_LWO(lwo_optim_destroy(optims[which]));
    destroy(grads[which], pools[which]);
  }
  ASSERT_LWO(lwo_nccl_comm_destroy(comm));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
