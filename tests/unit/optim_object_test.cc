// The optimizer object (lwo_optim) over a pool and its gradient set on the
// recording backend: a streamed training loop (stage, backward into the
// gradient slots in micro-batches, lwo_optim_step, the next forward's
// stages) against an f64 reference of the same updates on the gradients as
// they landed; the pool's bytes and the ring's slots equal the masters'
// rounding; clipping; skipped layers; checkpoint state; misuse statuses.
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <thread>

#include "src/common/dtype.h"

#include "test_util.h"
#include "unit/adamw_ref.h"

namespace lwo {
namespace testing {
namespace {

class OptimTest : public EngineTest {
 protected:
  // A pool of ModelDesc layers with weights drawn from N(0, 1) (bf16 weight,
  // f32 bias), and its gradient set.
  lwo_pool* make_model(uint32_t n, uint64_t seed) {
    lwo_pool* pool = make_pool(n, seed);
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (uint32_t l = 0; l < n; ++l) {
      uint32_t nt = 0;
      EXPECT_EQ(lwo_pool_layer_tensor_count(pool, l, &nt), LWO_OK);
      for (uint32_t k = 0; k < nt; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        EXPECT_EQ(lwo_pool_tensor_info(pool, l, k, &ti), LWO_OK);
        std::vector<uint8_t> bytes(ti.bytes);
        const uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype);
        for (uint64_t i = 0; i < ne; ++i) store_f32(bytes.data(), ti.dtype, i, normal(rng));
        EXPECT_EQ(lwo_pool_write(pool, l, ti.name, bytes.data(), ti.bytes), LWO_OK);
      }
    }
    return pool;
  }
  lwo_grads* make_grads(lwo_pool* pool, const uint8_t* trainable = nullptr) {
    lwo_grads_config c = LWO_GRADS_CONFIG_INIT;
    lwo_grads* g = nullptr;
    EXPECT_EQ(lwo_grads_create(pool, trainable, &c, &g), LWO_OK) << lwo_last_error_message();
    return g;
  }
  // Writes random gradients (scale `amp`) of `layer` into its staging slot.
  void backward(lwo_grads* g, lwo_pool* pool, uint32_t layer, StreamH s, std::mt19937& rng,
                float amp) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(g, layer, stream(s), &v));
    std::normal_distribution<float> normal(0.f, amp);
    for (uint32_t k = 0; k < v.n_tensors; ++k) {
      const uint64_t n = v.tensor_bytes[k] / lwo_dtype_size(v.tensor_dtypes[k]);
      gpu->write(s, v.tensors[k], v.tensor_bytes[k]);
      for (uint64_t i = 0; i < n; ++i) store_f32(v.tensors[k], v.tensor_dtypes[k], i, normal(rng));
    }
    ASSERT_LWO(lwo_grads_end(g, layer, stream(s)));
    (void)pool;
  }
  // The reference state of one tensor.
  struct Ref {
    std::vector<double> p, m, v;
    lwo_dtype_t dtype;
  };
  using Key = std::pair<uint32_t, std::string>;
  std::map<Key, Ref> reference(lwo_pool* pool, uint32_t n) {
    std::map<Key, Ref> r;
    for (uint32_t l = 0; l < n; ++l) {
      uint32_t nt = 0;
      EXPECT_EQ(lwo_pool_layer_tensor_count(pool, l, &nt), LWO_OK);
      for (uint32_t k = 0; k < nt; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        EXPECT_EQ(lwo_pool_tensor_info(pool, l, k, &ti), LWO_OK);
        void* host = nullptr;
        EXPECT_EQ(lwo_pool_tensor_host(pool, l, ti.name, &host, nullptr), LWO_OK);
        Ref& t = r[{l, ti.name}];
        const uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype);
        t.dtype = ti.dtype;
        t.p.resize(ne);
        t.m.assign(ne, 0);
        t.v.assign(ne, 0);
        for (uint64_t i = 0; i < ne; ++i) t.p[i] = load_f32(host, ti.dtype, i);
      }
    }
    return r;
  }
  // The gradients as they landed (read behind the fences).
  std::vector<double> landed(lwo_grads* g, uint32_t layer, const std::string& name) {
    lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
    EXPECT_EQ(lwo_grads_tensor(g, layer, name.c_str(), &gt), LWO_OK);
    std::vector<double> out(gt.n_elements);
    for (uint64_t i = 0; i < gt.n_elements; ++i) out[i] = load_f32(gt.data, gt.dtype, i);
    return out;
  }
  static void adam_ref(Ref& t, const std::vector<double>& g, const lwo_optim_step_params& p,
                       double c) {
    lwo_optim_test::adamw_ref(t, g, p, c, p.step);
  }
  // The masters against the reference, the pool's bytes their rounding.
  void check_state(lwo_optim* o, lwo_pool* pool, std::map<Key, Ref>& ref, double tol_lr,
                   double lr) {
    for (auto& kv : ref) {
      const uint32_t l = kv.first.first;
      const char* name = kv.first.second.c_str();
      Ref& t = kv.second;
      std::vector<float> master(t.p.size());
      ASSERT_LWO(lwo_optim_read(o, l, name, LWO_OPTIM_MASTER, master.data(), master.size() * 4));
      void* host = nullptr;
      ASSERT_LWO(lwo_pool_tensor_host(pool, l, name, &host, nullptr));
      for (size_t i = 0; i < t.p.size(); ++i) {
        ASSERT_NEAR(master[i], t.p[i], tol_lr * lr + 1e-6 * std::fabs(t.p[i]))
            << "layer " << l << " " << name << " element " << i;
        std::vector<uint8_t> want(4);
        store_f32(want.data(), t.dtype, 0, master[i]);
        ASSERT_EQ(0, std::memcmp(want.data(), static_cast<uint8_t*>(host) + i * lwo_dtype_size(t.dtype),
                                 lwo_dtype_size(t.dtype)))
            << "layer " << l << " " << name << " element " << i;
      }
    }
  }
  // Stages, acquires and releases `layer` on `s`: its slot must hold the
  // pool's bytes (after an update: the updated ones).
  void stage_holds(lwo_ring* ring, lwo_pool* pool, StreamH s, uint32_t layer) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, layer, &t));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(s), &v));
    ASSERT_TRUE(holds_layer(pool, v)) << "layer " << layer;
    ASSERT_LWO(lwo_ring_release(ring, t, stream(s)));
  }
  lwo_optim* make_optim(lwo_grads* g, lwo_dtype_t sd, uint32_t flags, uint32_t threads,
                        lwo_optim_kind_t kind = LWO_OPTIM_ADAMW) {
    lwo_optim_config c = LWO_OPTIM_CONFIG_INIT;
    c.kind = kind;
    c.state_dtype = sd;
    c.flags = flags;
    c.n_threads = threads;
    c.seed = 1234;
    lwo_optim* o = nullptr;
    EXPECT_EQ(lwo_optim_create(g, &c, &o), LWO_OK) << lwo_last_error_message();
    return o;
  }
};

// Ten streamed steps of two micro-batches (the second added on the host)
// with AdamW on f32 state: every stage after a step copies the updated
// bytes, the masters follow the f64 reference, the pool holds their
// rounding; then clipping, on a second optimizer of the same pool, and
// clipping with the squares of gradients the optimizer does not hold
// (extra_sumsq) in the norm.
TEST_F(OptimTest, StreamedTrainingLoopMatchesAnF64Reference) {
  const uint32_t L = 5;
  for (int clip = 0; clip < 3; ++clip) {
    SCOPED_TRACE(clip == 2 ? "clipping with extra_sumsq" : clip ? "clipping" : "no clipping");
    lwo_pool* pool = make_model(L, 7 + clip);
    lwo_grads* g = make_grads(pool);
    lwo_ring* ring = make_ring(pool, 2);
    lwo_optim* o = make_optim(g, LWO_DTYPE_F32, clip ? LWO_OPTIM_CLIPPING : 0, clip ? 3 : 2);
    auto ref = reference(pool, L);
    StreamH s = gpu->new_stream();
    std::mt19937 rng(99);
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    p.lr = 1e-2;
    p.weight_decay = 0.05;
    p.max_norm = clip ? 100.0 : 0.0;  // the norm: about 44 (amplitude 0.3), 290 (2)
    p.extra_sumsq = clip == 2 ? 60.0 * 60.0 : 0.0;  // with it: about 75, 296
    uint64_t n_clipped = 0;
    for (uint64_t step = 1; step <= 10; ++step) {
      // Forward: each layer staged (after the previous step: its update).
      for (uint32_t l = 0; l < L; ++l)
        ASSERT_NO_FATAL_FAILURE(stage_holds(ring, pool, s, l)) << "step " << step;
      // Backward: two micro-batches in reverse order, then the step.
      ASSERT_LWO(lwo_grads_zero(g));
      for (int micro = 0; micro < 2; ++micro)
        for (uint32_t l = L; l-- > 0;) backward(g, pool, l, s, rng, step % 3 == 0 ? 2.f : 0.3f);
      p.step = step;
      ASSERT_LWO(lwo_optim_step(o, &p));
      ASSERT_LWO(lwo_optim_wait(o));
      ASSERT_LWO(lwo_grads_wait(g));
      // The reference, from the gradients as they landed.
      double sq = 0;
      std::map<Key, std::vector<double>> grads;
      for (auto& kv : ref) {
        grads[kv.first] = landed(g, kv.first.first, kv.first.second);
        for (double x : grads[kv.first]) sq += x * x;
      }
      double c = 1;
      if (clip) {
        sq += p.extra_sumsq;
        c = std::min(1.0, p.max_norm / (std::sqrt(sq) + 1e-6));
        n_clipped += c < 1;
        lwo_optim_stats st{};
        st.size = sizeof st;
        ASSERT_LWO(lwo_optim_get_stats(o, &st));
        EXPECT_NEAR(st.last_norm, std::sqrt(sq), 1e-9 * std::sqrt(sq));
      }
      for (auto& kv : ref) adam_ref(kv.second, grads[kv.first], p, c);
      check_state(o, pool, ref, 10 * 1e-4, p.lr);
    }
    lwo_optim_stats st{};
    st.size = sizeof st;
    ASSERT_LWO(lwo_optim_get_stats(o, &st));
    EXPECT_EQ(st.n_steps, 10u);
    if (clip) {
      EXPECT_GT(n_clipped, 0u);
      EXPECT_LT(n_clipped, 10u);
      EXPECT_EQ(st.n_clipped, n_clipped);
      EXPECT_EQ(st.n_redone, n_clipped * L);
      EXPECT_EQ(st.n_layer_updates, 10u * L + n_clipped * L);
    } else {
      EXPECT_EQ(st.n_layer_updates, 10u * L);
    }
    lwo_optim_info info{};
    info.size = sizeof info;
    ASSERT_LWO(lwo_optim_get_info(o, &info));
    EXPECT_EQ(info.last_step, 10u);
    EXPECT_EQ(info.n_threads, clip ? 3u : 2u);
    EXPECT_NE(info.vector_level, nullptr);
    ASSERT_LWO(lwo_ring_release_all(ring, stream(s), nullptr));
    EXPECT_EQ(lwo_grads_destroy(g), LWO_ERR_BUSY);  // the optimizer holds it
    ASSERT_LWO(lwo_optim_destroy(o));
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  }
}

// Hyperparameter groups (lwo_optim_set_group, lwo_optim_step_groups): tensor
// k of layer l in group (l + k) % 2, group 1 with another lr, beta1, step
// count and no weight decay; the
// masters follow the f64 reference of each tensor's own group; misuse.
TEST_F(OptimTest, GroupsTakeTheirOwnHyperparameters) {
  const uint32_t L = 3;
  lwo_pool* pool = make_model(L, 21);
  lwo_grads* g = make_grads(pool);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, 0, 2);
  auto ref = reference(pool, L);
  std::map<Key, uint32_t> group;
  for (uint32_t l = 0; l < L; ++l) {
    uint32_t nt = 0;
    ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &nt));
    for (uint32_t k = 0; k < nt; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
      group[{l, ti.name}] = (l + k) % 2;
      if ((l + k) % 2) ASSERT_LWO(lwo_optim_set_group(o, l, ti.name, 1));
    }
  }
  lwo_optim_step_params p[2] = {LWO_OPTIM_STEP_PARAMS_INIT, LWO_OPTIM_STEP_PARAMS_INIT};
  p[0].lr = 1e-2;
  p[0].weight_decay = 0.05;
  p[1].lr = 3e-3;
  p[1].weight_decay = 0.0;
  p[1].beta1 = 0.8;
  // One set for a step whose tensors are in two groups: refused, naming one.
  ASSERT_LWO(lwo_grads_zero(g));
  StreamH s = gpu->new_stream();
  std::mt19937 rng(5);
  for (uint32_t l = L; l-- > 0;) backward(g, pool, l, s, rng, 0.5f);
  EXPECT_EQ(lwo_optim_step(o, &p[0]), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("is in group 1"), std::string::npos);
  EXPECT_EQ(lwo_optim_step_groups(o, p, 0), LWO_ERR_INVALID_ARGUMENT);
  p[1].beta2 = 1.0;  // a group's value out of range: named
  EXPECT_EQ(lwo_optim_step_groups(o, p, 2), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("group 1: beta2"), std::string::npos);
  p[1].beta2 = 0.999;
  for (uint64_t step = 1; step <= 4; ++step) {
    if (step > 1) {
      ASSERT_LWO(lwo_grads_zero(g));
      for (uint32_t l = L; l-- > 0;) backward(g, pool, l, s, rng, 0.5f);
    }
    p[0].step = step;
    p[1].step = step + 2;  // a group's own step count (its bias correction)
    ASSERT_LWO(lwo_optim_step_groups(o, p, 2));
    ASSERT_LWO(lwo_optim_wait(o));
    ASSERT_LWO(lwo_grads_wait(g));
    for (auto& kv : ref) adam_ref(kv.second, landed(g, kv.first.first, kv.first.second),
                                  p[group[kv.first]], 1.0);
    check_state(o, pool, ref, 10 * 1e-4, p[0].lr);
  }
  EXPECT_EQ(lwo_optim_set_group(o, 0, "no such tensor", 1), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_optim_set_group(o, L, "x", 1), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_optim_destroy(o));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

// The update order: every gradient here has landed before the dispatcher
// picks (the recording backend's events are done at once, and one
// micro-batch lands by DMA alone), so the step updates the layers in
// ascending order, the order the next forward stages them, although they
// landed last first; the delayed variant keeps the landing order (the next
// backward reads the last layer first).
TEST_F(OptimTest, LandedLayersUpdateInTheNextForwardsOrder) {
  const uint32_t L = 6;
  for (int delayed = 0; delayed < 2; ++delayed) {
    SCOPED_TRACE(delayed ? "delayed" : "immediate");
    lwo_pool* pool = make_model(L, 21);
    lwo_grads* g = make_grads(pool);
    lwo_optim* o = make_optim(g, LWO_DTYPE_F32, delayed ? LWO_OPTIM_DELAYED : 0, 2);
    StreamH s = gpu->new_stream();
    std::mt19937 rng(5);
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    p.lr = 1e-3;
    for (uint64_t step = 1; step <= 2; ++step) {
      ASSERT_LWO(lwo_grads_zero(g));
      for (uint32_t l = L; l-- > 0;) backward(g, pool, l, s, rng, 0.5f);
      ASSERT_LWO(lwo_grads_wait(g));  // every layer landed before the step
      p.step = step;
      ASSERT_LWO(lwo_optim_step(o, &p));
      ASSERT_LWO(lwo_optim_wait(o));
      std::vector<uint32_t> want(L);
      for (uint32_t l = 0; l < L; ++l) want[l] = delayed ? L - 1 - l : l;
      EXPECT_EQ(optim_last_order(o), want) << "step " << step;
    }
    ASSERT_LWO(lwo_optim_destroy(o));
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  }
}

// The one-step-delayed update against its definition: the masters follow
// the same f64 reference (the gradients here do not depend on the weights),
// while the pool, and so every slot the forward of step s reads, holds the
// rounding of the masters after step s - 2 (the initial weights for steps 1
// and 2); lwo_optim_wait brings the pool up to the masters.
TEST_F(OptimTest, DelayedUpdateLagsOneStep) {
  const uint32_t L = 4;
  lwo_pool* pool = make_model(L, 21);
  lwo_grads* g = make_grads(pool);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, LWO_OPTIM_DELAYED, 2);
  auto ref = reference(pool, L);
  // The masters after each step (exact f32), by (layer, tensor).
  std::vector<std::map<Key, std::vector<float>>> masters(1);
  for (auto& kv : ref) masters[0][kv.first].assign(kv.second.p.begin(), kv.second.p.end());
  StreamH s = gpu->new_stream();
  std::mt19937 rng(4);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1e-2;
  int stale_seen = 0;
  for (uint64_t step = 1; step <= 6; ++step) {
    const auto& want = masters[step >= 2 ? step - 2 : 0];
    for (uint32_t l = 0; l < L; ++l) {
      lwo_ticket t{};
      ASSERT_LWO(lwo_ring_stage(ring, l, &t));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_ring_acquire(ring, t, stream(s), &v));
      ASSERT_TRUE(holds_layer(pool, v));
      for (uint32_t k = 0; k < v.n_tensors; ++k) {
        const std::string name = k ? "bias" : "weight";
        const std::vector<float>& m = want.at({l, name});
        const lwo_dtype_t dt = v.tensor_dtypes[k];
        std::vector<uint8_t> bytes(m.size() * lwo_dtype_size(dt));
        for (size_t i = 0; i < m.size(); ++i) store_f32(bytes.data(), dt, i, m[i]);
        ASSERT_EQ(0, std::memcmp(bytes.data(), v.tensors[k], bytes.size()))
            << "step " << step << " layer " << l << " " << name;
        if (step >= 2) {  // the last step's masters are not there yet
          const std::vector<float>& newer = masters[step - 1].at({l, name});
          for (size_t i = 0; i < newer.size(); ++i) store_f32(bytes.data(), dt, i, newer[i]);
          stale_seen += std::memcmp(bytes.data(), v.tensors[k], bytes.size()) != 0;
        }
      }
      ASSERT_LWO(lwo_ring_release(ring, t, stream(s)));
    }
    ASSERT_LWO(lwo_grads_zero(g));
    for (uint32_t l = L; l-- > 0;) backward(g, pool, l, s, rng, 0.5f);
    p.step = step;
    ASSERT_LWO(lwo_optim_step(o, &p));
    // Done without lwo_optim_wait (which would bring the pool up to date).
    for (uint32_t done = 0; !done;) {
      ASSERT_LWO(lwo_optim_query(o, &done));
      if (!done) std::this_thread::yield();
    }
    ASSERT_LWO(lwo_grads_wait(g));
    masters.emplace_back();
    for (auto& kv : ref) {
      adam_ref(kv.second, landed(g, kv.first.first, kv.first.second), p, 1.0);
      std::vector<float>& m = masters.back()[kv.first];
      m.resize(kv.second.p.size());
      ASSERT_LWO(lwo_optim_read(o, kv.first.first, kv.first.second.c_str(), LWO_OPTIM_MASTER,
                                m.data(), m.size() * 4));
      for (size_t i = 0; i < m.size(); ++i)
        ASSERT_NEAR(m[i], kv.second.p[i], 10 * 1e-4 * p.lr + 1e-6 * std::fabs(kv.second.p[i]));
    }
  }
  EXPECT_GT(stale_seen, 0);
  ASSERT_LWO(lwo_optim_wait(o));
  for (auto& kv : ref) {
    void* host = nullptr;
    ASSERT_LWO(lwo_pool_tensor_host(pool, kv.first.first, kv.first.second.c_str(), &host, nullptr));
    const std::vector<float>& m = masters.back()[kv.first];
    for (size_t i = 0; i < m.size(); ++i) {
      std::vector<uint8_t> b(4);
      store_f32(b.data(), kv.second.dtype, 0, m[i]);
      ASSERT_EQ(0, std::memcmp(b.data(), static_cast<uint8_t*>(host) + i * lwo_dtype_size(kv.second.dtype),
                               lwo_dtype_size(kv.second.dtype)));
    }
  }
  lwo_optim_config c = LWO_OPTIM_CONFIG_INIT;
  c.flags = LWO_OPTIM_DELAYED | LWO_OPTIM_CLIPPING;
  lwo_optim* o2 = nullptr;
  EXPECT_EQ(lwo_optim_create(g, &c, &o2), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_ring_release_all(ring, stream(s), nullptr));
  ASSERT_LWO(lwo_optim_destroy(o));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

// Frozen layers and layers without a gradient since the last step are left
// alone; bf16 state with stochastic rounding is deterministic for a seed:
// two optimizers over two identical models give the same bits.
TEST_F(OptimTest, SkippedLayersAndDeterministicBf16State) {
  const uint32_t L = 4;
  const uint8_t trainable[L] = {1, 0, 1, 1};
  std::vector<std::vector<uint8_t>> bytes[2];
  for (int run = 0; run < 2; ++run) {
    lwo_pool* pool = make_model(L, 3);
    lwo_grads* g = make_grads(pool, trainable);
    lwo_optim* o = make_optim(g, LWO_DTYPE_BF16, LWO_OPTIM_STOCHASTIC_ROUNDING, run ? 1 : 4);
    StreamH s = gpu->new_stream();
    std::mt19937 rng(5);
    std::vector<uint8_t> before3;
    {
      void* h = nullptr;
      uint64_t b = 0;
      ASSERT_LWO(lwo_pool_layer_host(pool, 3, &h, &b));
      before3.assign(static_cast<uint8_t*>(h), static_cast<uint8_t*>(h) + b);
    }
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    for (uint64_t step = 1; step <= 3; ++step) {
      ASSERT_LWO(lwo_grads_zero(g));
      // Layer 3 gets no gradient: it is not updated.
      for (uint32_t l : {2u, 0u}) backward(g, pool, l, s, rng, 1.f);
      p.step = step;
      ASSERT_LWO(lwo_optim_step(o, &p));
      ASSERT_LWO(lwo_optim_wait(o));
    }
    lwo_optim_stats st{};
    st.size = sizeof st;
    ASSERT_LWO(lwo_optim_get_stats(o, &st));
    EXPECT_EQ(st.n_layer_updates, 6u);
    bytes[run].clear();
    for (uint32_t l = 0; l < L; ++l) {
      void* h = nullptr;
      uint64_t b = 0;
      ASSERT_LWO(lwo_pool_layer_host(pool, l, &h, &b));
      bytes[run].emplace_back(static_cast<uint8_t*>(h), static_cast<uint8_t*>(h) + b);
    }
    EXPECT_EQ(bytes[run][3], before3);
    // A step with no new gradient updates nothing.
    p.step = 4;
    ASSERT_LWO(lwo_optim_step(o, &p));
    ASSERT_LWO(lwo_optim_wait(o));
    ASSERT_LWO(lwo_optim_get_stats(o, &st));
    EXPECT_EQ(st.n_layer_updates, 6u);
    std::vector<uint16_t> m(37 * 19);
    ASSERT_LWO(lwo_optim_read(o, 0, "weight", LWO_OPTIM_M, m.data(), m.size() * 2));
    if (run == 1) {
      std::vector<uint16_t> m0(m.size());
      EXPECT_NE(m, m0);
    }
    ASSERT_LWO(lwo_optim_destroy(o));
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
  EXPECT_EQ(bytes[0], bytes[1]);
}

// A layer zeroed twice after its last gradient has had no gradient since
// the zero: the step leaves it alone (the second zero finds its buffers
// already cleared, which must not make the old gradient count again).
TEST_F(OptimTest, ZeroTwiceLeavesTheLayerOutOfTheStep) {
  lwo_pool* pool = make_model(2, 4);
  lwo_grads* g = make_grads(pool);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, 0, 1);
  StreamH s = gpu->new_stream();
  std::mt19937 rng(6);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  backward(g, pool, 1, s, rng, 1.f);
  ASSERT_LWO(lwo_optim_step(o, &p));
  ASSERT_LWO(lwo_optim_wait(o));
  backward(g, pool, 1, s, rng, 1.f);
  ASSERT_LWO(lwo_grads_zero(g));
  ASSERT_LWO(lwo_grads_zero(g));
  p.step = 2;
  ASSERT_LWO(lwo_optim_step(o, &p));
  ASSERT_LWO(lwo_optim_wait(o));
  lwo_optim_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_optim_get_stats(o, &st));
  EXPECT_EQ(st.n_layer_updates, 1u);
  ASSERT_LWO(lwo_optim_destroy(o));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// SGD with momentum through the object against its definition; the state
// written for a checkpoint and read back; masters written reach the pool.
TEST_F(OptimTest, SgdAndCheckpointState) {
  lwo_pool* pool = make_model(2, 4);
  lwo_grads* g = make_grads(pool);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, 0, 2, LWO_OPTIM_SGD);
  auto ref = reference(pool, 2);
  StreamH s = gpu->new_stream();
  std::mt19937 rng(8);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 0.05;
  p.momentum = 0.9;
  p.dampening = 0.1;
  p.weight_decay = 0.01;
  for (uint64_t step = 1; step <= 5; ++step) {
    ASSERT_LWO(lwo_grads_zero(g));
    for (uint32_t l : {1u, 0u}) backward(g, pool, l, s, rng, 1.f);
    p.step = step;
    ASSERT_LWO(lwo_optim_step(o, &p));
    ASSERT_LWO(lwo_optim_wait(o));
    ASSERT_LWO(lwo_grads_wait(g));
    for (auto& kv : ref) {
      auto gr = landed(g, kv.first.first, kv.first.second);
      Ref& t = kv.second;
      for (size_t i = 0; i < t.p.size(); ++i) {
        t.m[i] = step == 1 ? gr[i] : p.momentum * t.m[i] + (1 - p.dampening) * gr[i];
        t.p[i] = t.p[i] * (1 - p.lr * p.weight_decay) - p.lr * t.m[i];
      }
    }
    check_state(o, pool, ref, 5 * 1e-4, 1.0);
  }
  // Checkpoint: masters and momentum out, other values in, read back.
  const uint64_t n = 2 * 37;  // layer 1's bias
  std::vector<float> master(n), mom(n), back(n);
  ASSERT_LWO(lwo_optim_read(o, 1, "bias", LWO_OPTIM_MASTER, master.data(), n * 4));
  ASSERT_LWO(lwo_optim_read(o, 1, "bias", LWO_OPTIM_M, mom.data(), n * 4));
  for (uint64_t i = 0; i < n; ++i) {
    master[i] = 0.25f * static_cast<float>(i);
    mom[i] = -static_cast<float>(i);
  }
  ASSERT_LWO(lwo_optim_write(o, 1, "bias", LWO_OPTIM_MASTER, master.data(), n * 4));
  ASSERT_LWO(lwo_optim_write(o, 1, "bias", LWO_OPTIM_M, mom.data(), n * 4));
  ASSERT_LWO(lwo_optim_read(o, 1, "bias", LWO_OPTIM_M, back.data(), n * 4));
  EXPECT_EQ(back, mom);
  void* host = nullptr;
  ASSERT_LWO(lwo_pool_tensor_host(pool, 1, "bias", &host, nullptr));
  EXPECT_EQ(0, std::memcmp(host, master.data(), n * 4));  // f32 bias: the masters exactly
  // A 16-bit weight's masters reach the pool rounded (nearest even).
  {
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 0, &ti));
    const uint64_t nw = ti.bytes / lwo_dtype_size(ti.dtype);
    std::vector<float> mw(nw);
    for (uint64_t i = 0; i < nw; ++i) mw[i] = 1.0f + static_cast<float>(i) * 0x1.0p-9f;  // midpoints among them
    ASSERT_LWO(lwo_optim_write(o, 1, ti.name, LWO_OPTIM_MASTER, mw.data(), nw * 4));
    void* wh = nullptr;
    ASSERT_LWO(lwo_pool_tensor_host(pool, 1, ti.name, &wh, nullptr));
    std::vector<uint8_t> want(ti.bytes);
    for (uint64_t i = 0; i < nw; ++i) store_f32(want.data(), ti.dtype, i, mw[i]);
    EXPECT_EQ(0, std::memcmp(wh, want.data(), ti.bytes)) << ti.name << " " << lwo_dtype_name(ti.dtype);
  }
  // Misuse of the state calls.
  EXPECT_EQ(lwo_optim_read(o, 1, "bias", LWO_OPTIM_MASTER, back.data(), n * 4 - 4), LWO_ERR_SIZE_MISMATCH);
  EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_optim_read"), std::string::npos);
  EXPECT_EQ(lwo_optim_read(o, 1, "bias", LWO_OPTIM_V, back.data(), n * 4), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_optim_read(o, 1, "nope", LWO_OPTIM_M, back.data(), n * 4), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_optim_read(o, 9, "bias", LWO_OPTIM_M, back.data(), n * 4), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_optim_destroy(o));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(OptimTest, MisuseHasDistinctStatuses) {
  lwo_pool* pool = make_model(2, 1);
  lwo_grads* g = make_grads(pool);
  lwo_optim* o = nullptr;
  lwo_optim_config c = LWO_OPTIM_CONFIG_INIT;
  c.state_dtype = LWO_DTYPE_F16;
  EXPECT_EQ(lwo_optim_create(g, &c, &o), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(o, nullptr);
  c = LWO_OPTIM_CONFIG_INIT;
  c.flags = LWO_OPTIM_STOCHASTIC_ROUNDING;  // with f32 state
  EXPECT_EQ(lwo_optim_create(g, &c, &o), LWO_ERR_INVALID_ARGUMENT);
  c = LWO_OPTIM_CONFIG_INIT;
  c.flags = 0x80;
  EXPECT_EQ(lwo_optim_create(g, &c, &o), LWO_ERR_INVALID_ARGUMENT);
  c = LWO_OPTIM_CONFIG_INIT;
  c.kind = static_cast<lwo_optim_kind_t>(7);
  EXPECT_EQ(lwo_optim_create(g, &c, &o), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_optim_create(nullptr, nullptr, &o), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_optim_create(g, nullptr, &o));
  lwo_optim* o2 = nullptr;
  EXPECT_EQ(lwo_optim_create(g, nullptr, &o2), LWO_ERR_BUSY);  // one per gradient set
  EXPECT_NE(std::string(lwo_last_error_message()).find("already has an optimizer"), std::string::npos);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.step = 0;
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_INVALID_ARGUMENT);
  p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.beta2 = 1.0;
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_INVALID_ARGUMENT);
  p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.max_norm = 1.0;  // without LWO_OPTIM_CLIPPING
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("LWO_OPTIM_CLIPPING"), std::string::npos);
  p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = NAN;
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_INVALID_ARGUMENT);
  p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.extra_sumsq = -1.0;
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("extra_sumsq"), std::string::npos);
  EXPECT_EQ(lwo_optim_step(o, nullptr), LWO_ERR_INVALID_ARGUMENT);
  // Still usable: a valid step (no gradient yet: nothing to update).
  p = LWO_OPTIM_STEP_PARAMS_INIT;
  ASSERT_LWO(lwo_optim_step(o, &p));
  ASSERT_LWO(lwo_optim_wait(o));
  uint32_t done = 0;
  ASSERT_LWO(lwo_optim_query(o, &done));
  EXPECT_EQ(done, 1u);
  ASSERT_LWO(lwo_optim_destroy(o));
  EXPECT_EQ(lwo_optim_destroy(o), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// A step while one runs is refused: a layer of 2^22 parameters updated on
// one thread takes milliseconds, the second call microseconds.
TEST_F(OptimTest, StepWhileOneRunsIsBusy) {
  std::vector<lwo_tensor_desc> t{tensor("weight", LWO_DTYPE_BF16, {1 << 11, 1 << 11})};
  lwo_layer_desc d{t.data(), 1, nullptr};
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &d, 1, nullptr, &pool));
  lwo_grads* g = make_grads(pool);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, 0, 1);
  StreamH s = gpu->new_stream();
  std::mt19937 rng(1);
  backward(g, pool, 0, s, rng, 1.f);
  std::vector<float> m(1 << 22);
  // The optimizer's thread is held where it waits for the layer's landing
  // (an event sync on a thread other than this one) until the checks below
  // are done, so the step is running whatever the machine's load.
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  const std::thread::id test_thread = std::this_thread::get_id();
  gpu->on_event_sync = [open, test_thread] {
    if (std::this_thread::get_id() != test_thread) open.wait();
  };
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  ASSERT_LWO(lwo_optim_step(o, &p));
  p.step = 2;
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_optim_read(o, 0, "weight", LWO_OPTIM_M, m.data(), m.size() * 4), LWO_ERR_BUSY);
  EXPECT_NE(std::string(lwo_last_error_message()).find("still running"), std::string::npos);
  gate.set_value();
  ASSERT_LWO(lwo_optim_wait(o));
  gpu->on_event_sync = nullptr;
  ASSERT_LWO(lwo_optim_read(o, 0, "weight", LWO_OPTIM_M, m.data(), m.size() * 4));
  ASSERT_LWO(lwo_optim_step(o, &p));  // usable again
  ASSERT_LWO(lwo_optim_destroy(o));     // waits for it
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// An open step (lwo_optim_step_open, _add, _close): each layer added is
// updated while the step is still open (before any later layer is even
// ended), the last layers come with the close; the masters follow the f64
// reference and equal, bit for bit, an optimizer of the same pool and
// gradients stepped with lwo_optim_step; then the calls refused while a
// step is open, and after.
TEST_F(OptimTest, AnOpenStepUpdatesEachLayerAsItIsAdded) {
  const uint32_t L = 4;
  lwo_pool* pool = make_model(L, 31);
  lwo_pool* twin = make_model(L, 31);
  lwo_grads* g = make_grads(pool);
  lwo_grads* gt = make_grads(twin);
  lwo_optim* o = make_optim(g, LWO_DTYPE_F32, 0, 2);
  lwo_optim* ot = make_optim(gt, LWO_DTYPE_F32, 0, 2);
  lwo_ring* ring = make_ring(pool, 2);
  auto ref = reference(pool, L);
  StreamH s = gpu->new_stream();
  std::mt19937 rng(3), rng_t(3);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1e-2;
  p.weight_decay = 0.05;
  auto updates = [&] {
    lwo_optim_stats st{};
    st.size = sizeof st;
    EXPECT_EQ(lwo_optim_get_stats(o, &st), LWO_OK);
    return st.n_layer_updates;
  };
  for (uint64_t step = 1; step <= 3; ++step) {
    p.step = step;
    ASSERT_LWO(lwo_grads_zero(g));
    ASSERT_LWO(lwo_grads_zero(gt));
    ASSERT_LWO(lwo_optim_step_open(o, &p, 1));
    // Layers L-1 .. 1 added one at a time, each updated before the next is
    // ended; layer 0 is ended and left to the close.
    for (uint32_t l = L; l-- > 0;) {
      backward(g, pool, l, s, rng, 0.5f);
      backward(gt, twin, l, s, rng_t, 0.5f);
      if (l == 0) break;
      const uint64_t before = updates();
      ASSERT_LWO(lwo_optim_step_add(o, l));
      auto t0 = std::chrono::steady_clock::now();
      while (updates() == before &&
             std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      ASSERT_EQ(updates(), before + 1) << "step " << step << ": layer " << l
                                       << " was not updated while the step was open";
      // A stage of an updated layer while the step is open copies its new bytes.
      ASSERT_NO_FATAL_FAILURE(stage_holds(ring, pool, s, l)) << "step " << step;
    }
    ASSERT_LWO(lwo_optim_step_close(o));
    ASSERT_LWO(lwo_optim_step(ot, &p));
    ASSERT_LWO(lwo_optim_wait(o));
    ASSERT_LWO(lwo_optim_wait(ot));
    ASSERT_LWO(lwo_grads_wait(g));
    for (auto& kv : ref) adam_ref(kv.second, landed(g, kv.first.first, kv.first.second), p, 1.0);
    check_state(o, pool, ref, 10 * 1e-4, p.lr);
    for (auto& kv : ref) {
      const uint32_t l = kv.first.first;
      const char* name = kv.first.second.c_str();
      std::vector<float> a(kv.second.p.size()), b(a.size());
      ASSERT_LWO(lwo_optim_read(o, l, name, LWO_OPTIM_MASTER, a.data(), a.size() * 4));
      ASSERT_LWO(lwo_optim_read(ot, l, name, LWO_OPTIM_MASTER, b.data(), b.size() * 4));
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "layer " << l << " " << name;
    }
  }
  EXPECT_EQ(updates(), 3u * L);
  // Refused while open; then usable.
  ASSERT_LWO(lwo_grads_zero(g));
  EXPECT_EQ(lwo_optim_step_add(o, 1), LWO_ERR_TICKET_STATE);  // no step open
  EXPECT_NE(std::string(lwo_last_error_message()).find("no step is open"), std::string::npos);
  EXPECT_EQ(lwo_optim_step_close(o), LWO_ERR_TICKET_STATE);
  p.step = 4;
  ASSERT_LWO(lwo_optim_step_open(o, &p, 1));
  EXPECT_EQ(lwo_optim_step_add(o, 1), LWO_ERR_TICKET_STATE);  // no gradient since zero
  EXPECT_NE(std::string(lwo_last_error_message()).find("has no gradient ended"), std::string::npos);
  EXPECT_EQ(lwo_optim_step_add(o, L), LWO_ERR_OUT_OF_RANGE);
  backward(g, pool, 1, s, rng, 0.5f);
  ASSERT_LWO(lwo_optim_step_add(o, 1));
  EXPECT_EQ(lwo_optim_step_add(o, 1), LWO_ERR_TICKET_STATE);  // already in the step
  EXPECT_NE(std::string(lwo_last_error_message()).find("already in step 4"), std::string::npos);
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(g, 1, stream(s), &v), LWO_ERR_TICKET_STATE);  // taken
  EXPECT_NE(std::string(lwo_last_error_message()).find("open step 4"), std::string::npos);
  EXPECT_EQ(lwo_optim_wait(o), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_optim_step(o, &p), LWO_ERR_BUSY);
  EXPECT_NE(std::string(lwo_last_error_message()).find("is open"), std::string::npos);
  EXPECT_EQ(lwo_optim_step_open(o, &p, 1), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_optim_set_group(o, 1, "weight", 0), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_optim_destroy(o), LWO_ERR_BUSY);
  backward(g, pool, 0, s, rng, 0.5f);  // another layer: fine while open
  ASSERT_LWO(lwo_optim_step_close(o));
  ASSERT_LWO(lwo_optim_wait(o));
  EXPECT_EQ(updates(), 3u * L + 2);  // layer 1 added, layer 0 by the close
  backward(g, pool, 1, s, rng, 0.5f);  // the next step's gradient: accepted again
  ASSERT_LWO(lwo_grads_wait(g));
  // Clipping and a delayed optimizer are not for open steps.
  lwo_optim_destroy(ot);
  lwo_optim_step_params q = LWO_OPTIM_STEP_PARAMS_INIT;
  q.max_norm = 1.0;
  lwo_optim* oc = make_optim(gt, LWO_DTYPE_F32, LWO_OPTIM_CLIPPING, 1);
  EXPECT_EQ(lwo_optim_step_open(oc, &q, 1), LWO_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lwo_last_error_message()).find("max_norm"), std::string::npos);
  ASSERT_LWO(lwo_optim_destroy(oc));
  lwo_optim* od = make_optim(gt, LWO_DTYPE_F32, LWO_OPTIM_DELAYED, 1);
  EXPECT_EQ(lwo_optim_step_open(od, &p, 1), LWO_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lwo_last_error_message()).find("DELAYED"), std::string::npos);
  ASSERT_LWO(lwo_optim_destroy(od));
  EXPECT_EQ(lwo_optim_step_open(o, nullptr, 1), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_optim_step_open(o, &p, 0), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_optim_step_add(nullptr, 0), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_ring_release_all(ring, stream(s), nullptr));
  ASSERT_LWO(lwo_optim_destroy(o));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_grads_destroy(gt));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_pool_destroy(twin));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

}  // namespace
}  // namespace testing
}  // namespace lwo
