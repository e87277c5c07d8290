// The host optimizer in a streamed training loop on the GPU: each
// step stages every layer for the forward (the device bytes must be the
// rounding of the masters after the previous step: the stage waited for the
// layer's update), then a backward in reverse layer order whose gradients
// (known random values, one or two micro-batches) go to host through the
// gradient set, then lwo_optim_step, which updates each layer as it lands.
// The masters follow an f64 reference of the same updates on the gradients
// as they landed; with clipping too.
#include <map>

#include "gpu_util.h"
#include "unit/adamw_ref.h"

namespace lwo_test {
namespace {

float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {  // nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct RefTensor {
  std::vector<double> p, m, v;
  bool bf16 = false;
};

void run_loop(bool clip) {
  const uint32_t L = 6, R = 256, C = 384;
  lwo_engine_config ec = LWO_ENGINE_CONFIG_INIT;
  lwo_engine* engine = nullptr;
  CHECK_LWO(lwo_engine_create(&ec, &engine));
  std::vector<std::vector<lwo_tensor_desc>> td(L);
  std::vector<lwo_layer_desc> ld(L);
  for (uint32_t l = 0; l < L; ++l) {
    const lwo_tensor_desc w = tensor_desc("weight", LWO_DTYPE_BF16, {R, C});
    const lwo_tensor_desc b = tensor_desc("bias", LWO_DTYPE_F32, {R});
    td[l] = {w, b};
    ld[l] = lwo_layer_desc{td[l].data(), 2, nullptr};
  }
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine, ld.data(), L, nullptr, &pool));
  std::mt19937 rng(clip ? 11 : 10);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::map<std::pair<uint32_t, int>, RefTensor> ref;
  for (uint32_t l = 0; l < L; ++l) {
    std::vector<uint16_t> w(R * C);
    std::vector<float> b(R);
    RefTensor& rw = ref[{l, 0}];
    RefTensor& rb = ref[{l, 1}];
    rw.bf16 = true;
    for (auto& x : w) {
      x = float_to_bf16(normal(rng));
      rw.p.push_back(bf16_to_float(x));
    }
    for (auto& x : b) {
      x = normal(rng);
      rb.p.push_back(x);
    }
    CHECK_LWO(lwo_pool_write(pool, l, "weight", w.data(), w.size() * 2));
    CHECK_LWO(lwo_pool_write(pool, l, "bias", b.data(), b.size() * 4));
  }
  for (auto& kv : ref) {
    kv.second.m.assign(kv.second.p.size(), 0);
    kv.second.v.assign(kv.second.p.size(), 0);
  }
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  rc.depth = 2;
  lwo_ring* ring = nullptr;
  CHECK_LWO(lwo_ring_create(pool, &rc, &ring));
  lwo_grads* grads = nullptr;
  CHECK_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.flags = clip ? LWO_OPTIM_CLIPPING : 0u;
  oc.n_threads = 4;
  lwo_optim* optim = nullptr;
  CHECK_LWO(lwo_optim_create(grads, &oc, &optim));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Pinned sources of the gradients (bf16 weight, f32 bias), per layer and
  // micro-batch, and a pinned landing place for the forward's device bytes.
  const size_t wbytes = R * C * 2, bbytes = R * 4;
  uint8_t* src = nullptr;
  CUDA_OK(cudaMallocHost(&src, L * 2 * (wbytes + bbytes)));
  uint8_t* seen = nullptr;
  CUDA_OK(cudaMallocHost(&seen, L * (wbytes + bbytes)));
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.max_norm = clip ? 90.0 : 0.0;  // the norm is about 77 (1 micro-batch) and 109 (2)
  uint64_t clipped = 0;
  // The reference of step `step - 1` on the gradients as they landed (they
  // stay in the buffers until the next zero), and the masters against it.
  auto check_step = [&](uint64_t step) {
    if (step == 1) return;
    const uint64_t k = step - 1;
    CHECK_LWO(lwo_grads_wait(grads));
    std::map<std::pair<uint32_t, int>, std::vector<double>> g;
    double sq = 0;
    for (auto& kv : ref) {
      lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
      CHECK_LWO(lwo_grads_tensor(grads, kv.first.first, kv.first.second ? "bias" : "weight", &gt));
      std::vector<double>& x = g[kv.first];
      for (uint64_t i = 0; i < gt.n_elements; ++i)
        x.push_back(gt.dtype == LWO_DTYPE_BF16 ? bf16_to_float(static_cast<const uint16_t*>(gt.data)[i])
                                               : static_cast<const float*>(gt.data)[i]);
      for (double e : x) sq += e * e;
    }
    const double c = clip ? std::min(1.0, p.max_norm / (std::sqrt(sq) + 1e-6)) : 1.0;
    clipped += c < 1;
    for (auto& kv : ref) {
      RefTensor& r = kv.second;
      lwo_optim_test::adamw_ref(r, g[kv.first], p, c, k);
      std::vector<float> master(r.p.size());
      CHECK_LWO(lwo_optim_read(optim, kv.first.first, kv.first.second ? "bias" : "weight",
                               LWO_OPTIM_MASTER, master.data(), master.size() * 4));
      for (size_t i = 0; i < r.p.size(); ++i)
        ASSERT_NEAR(master[i], r.p[i], k * (1e-6 * p.lr + 6e-8 * std::fabs(r.p[i])) * 4)
            << "step " << k << " layer " << kv.first.first << " i " << i;
    }
  };
  for (uint64_t step = 1; step <= 8; ++step) {
    // Forward: every device copy is the masters' rounding.
    for (uint32_t l = 0; l < L; ++l) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring, l, s, &t, &v));
      CUDA_OK(cudaMemcpyAsync(seen + l * (wbytes + bbytes), v.tensors[0], wbytes, cudaMemcpyDeviceToHost, s));
      CUDA_OK(cudaMemcpyAsync(seen + l * (wbytes + bbytes) + wbytes, v.tensors[1], bbytes, cudaMemcpyDeviceToHost, s));
      CHECK_LWO(lwo_ring_release(ring, t, s));
    }
    CUDA_OK(cudaStreamSynchronize(s));
    CHECK_LWO(lwo_optim_wait(optim));  // done already: every layer was staged
    check_step(step);
    if (::testing::Test::HasFatalFailure()) break;
    for (uint32_t l = 0; l < L; ++l) {
      std::vector<float> mw(R * C), mb(R);
      CHECK_LWO(lwo_optim_read(optim, l, "weight", LWO_OPTIM_MASTER, mw.data(), mw.size() * 4));
      CHECK_LWO(lwo_optim_read(optim, l, "bias", LWO_OPTIM_MASTER, mb.data(), mb.size() * 4));
      const uint16_t* dw = reinterpret_cast<const uint16_t*>(seen + l * (wbytes + bbytes));
      const float* db = reinterpret_cast<const float*>(seen + l * (wbytes + bbytes) + wbytes);
      for (uint32_t i = 0; i < R * C; ++i)
        ASSERT_EQ(dw[i], float_to_bf16(mw[i])) << "step " << step << " layer " << l << " i " << i;
      ASSERT_EQ(0, std::memcmp(db, mb.data(), bbytes)) << "step " << step << " layer " << l;
    }
    // Backward, in reverse, one or two micro-batches.
    CHECK_LWO(lwo_grads_zero(grads));
    const int micros = step % 2 ? 1 : 2;
    for (uint32_t l = 0; l < L; ++l)
      for (int mb = 0; mb < micros; ++mb) {
        uint8_t* w = src + (l * 2 + mb) * (wbytes + bbytes);
        uint16_t* gw = reinterpret_cast<uint16_t*>(w);
        float* gb = reinterpret_cast<float*>(w + wbytes);
        for (uint32_t i = 0; i < R * C; ++i) gw[i] = float_to_bf16(0.1f * normal(rng));
        for (uint32_t i = 0; i < R; ++i) gb[i] = 0.1f * normal(rng);
      }
    for (int mb = 0; mb < micros; ++mb)
      for (uint32_t l = L; l-- > 0;) {
        lwo_ticket t{};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring, l, s, &t, &v));
        lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
        CHECK_LWO(lwo_grads_begin(grads, l, s, &gv));
        uint8_t* w = src + (l * 2 + mb) * (wbytes + bbytes);
        CUDA_OK(cudaMemcpyAsync(gv.tensors[0], w, wbytes, cudaMemcpyHostToDevice, s));
        CUDA_OK(cudaMemcpyAsync(gv.tensors[1], w + wbytes, bbytes, cudaMemcpyHostToDevice, s));
        CHECK_LWO(lwo_grads_end(grads, l, s));
        CHECK_LWO(lwo_ring_release(ring, t, s));
      }
    p.step = step;
    CHECK_LWO(lwo_optim_step(optim, &p));  // no wait: the next forward's stages wait per layer
  }
  CHECK_LWO(lwo_optim_wait(optim));
  if (!::testing::Test::HasFatalFailure()) check_step(9);
  lwo_optim_stats st{};
  st.size = sizeof st;
  CHECK_LWO(lwo_optim_get_stats(optim, &st));
  EXPECT_EQ(st.n_steps, 8u);
  EXPECT_EQ(st.n_layer_updates, 8u * L + st.n_redone);
  if (clip) {
    EXPECT_EQ(st.n_clipped, clipped);
    EXPECT_GT(clipped, 0u);
    EXPECT_LT(clipped, 8u);
  }
  std::printf("optimizer: %llu layer updates, %.2f ms updating, %.2f ms waiting for landings, "
              "last step %.2f ms of which %.2f ms after the last landing\n",
              static_cast<unsigned long long>(st.n_layer_updates), st.update_ns / 1e6,
              st.landing_wait_ns / 1e6, st.last_step_ns / 1e6, st.last_tail_ns / 1e6);
  CHECK_LWO(lwo_ring_release_all(ring, s, nullptr));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK_LWO(lwo_optim_destroy(optim));
  CHECK_LWO(lwo_grads_destroy(grads));
  CHECK_LWO(lwo_ring_destroy(ring));
  CHECK_LWO(lwo_pool_destroy(pool));
  CUDA_OK(cudaFreeHost(src));
  CUDA_OK(cudaFreeHost(seen));
  CUDA_OK(cudaStreamDestroy(s));
  CHECK_LWO(lwo_engine_destroy(engine));
}

TEST(OptimGpu, StreamedTrainingLoopMatchesAnF64Reference) {
  LWO_REQUIRE_GPU();
  run_loop(false);
}

TEST(OptimGpu, StreamedTrainingLoopWithClippingMatchesAnF64Reference) {
  LWO_REQUIRE_GPU();
  run_loop(true);
}

}  // namespace
}  // namespace lwo_test
