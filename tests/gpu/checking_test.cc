// Checking mode (LWO_ENGINE_CHECKING) on the real device: a consumer kernel
// launched after its ticket was released (the early release of a caller
// bug) reads the pattern, not the layer; a host read of the gradients before
// lwo_grads_wait reads NaN, not plausible numbers.
#include "gpu/gpu_util.h"
#include "testkit/spin.h"

namespace lwo_test {
namespace {

class Checking : public GpuTest {
 protected:
  uint32_t engine_flags() const override { return LWO_ENGINE_CHECKING; }
  void SetUp() override {
    GpuTest::SetUp();
    if (!have_gpu_ || HasFatalFailure()) return;
    CUDA_OK(cudaMalloc(&sum_, sizeof(unsigned long long)));
    std::vector<LayerSpec> specs(3);
    for (uint32_t l = 0; l < 3; ++l) {
      specs[l].push_back(make_tensor("weight", LWO_DTYPE_BF16, {256 + 64 * l, 64}));
      specs[l].push_back(make_tensor("bias", LWO_DTYPE_F32, {64}));
    }
    ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, std::move(specs), test_seed(28), &tp_));
  }
  void TearDown() override {
    if (stream(0)) {
      EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream(0)));
    }
    if (sum_) {
      EXPECT_EQ(cudaSuccess, cudaFree(sum_));
    }
    EXPECT_LWO_OK(tp_.destroy());
    GpuTest::TearDown();  // checks and destroys the engine
  }
  // The checksum a kernel on the stream computes of [p, p + bytes), now.
  uint64_t device_checksum(const void* p, uint64_t bytes) {
    unsigned long long got = 0;
    EXPECT_EQ(cudaSuccess, cudaMemsetAsync(sum_, 0, sizeof got, stream(0)));
    EXPECT_EQ(cudaSuccess, lwo::kernels::checksum_async(p, bytes, sum_, stream(0)));
    EXPECT_EQ(cudaSuccess, cudaMemcpyAsync(&got, sum_, sizeof got, cudaMemcpyDeviceToHost,
                                           stream(0)));
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream(0)));
    return got;
  }
  static uint64_t pattern_checksum(uint64_t bytes) {
    std::vector<uint8_t> p(bytes, LWO_CHECKING_BYTE);
    return lwo::kernels::checksum_host(p.data(), p.size());
  }

  TestPool tp_;
  unsigned long long* sum_ = nullptr;
};

TEST_F(Checking, KernelAfterAnEarlyReleaseReadsThePattern) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  for (uint32_t l = 0; l < tp_.n_layers(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    lwo_ticket t{0};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, stream(0), &t, &v));
    const LayerRef& lr = tp_.layers[l];
    // Before the release the kernel reads the layer...
    EXPECT_EQ(lr.whole_sum, device_checksum(v.base, lr.whole_bytes));
    // ...after it (the caller's bug: its kernel was enqueued too late) the
    // pattern, never the stale layer.
    CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
    EXPECT_EQ(pattern_checksum(v.record_bytes), device_checksum(v.base, v.record_bytes));
  }
  // Staged again, each layer is copied again and arrives whole.
  for (uint32_t l = 0; l < tp_.n_layers(); ++l) {
    lwo_ticket t{0};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, stream(0), &t, &v));
    EXPECT_EQ(tp_.layers[l].whole_sum, device_checksum(v.base, tp_.layers[l].whole_bytes));
    CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
  }
  lwo_ring_stats st;
  std::memset(&st, 0, sizeof st);
  st.size = sizeof st;
  CHECK_LWO(lwo_ring_get_stats(ring.get(), &st));
  EXPECT_EQ(0u, st.n_hits);
  CHECK_LWO(ring.reset());
}

TEST_F(Checking, HostReadBeforeTheFenceSeesNaN) {
  lwo_grads_config gc;
  lwo_grads_config_init(&gc);
  gc.flags = LWO_GRADS_F32;
  lwo_grads* grads = nullptr;
  CHECK_LWO(lwo_grads_create(tp_.pool, nullptr, &gc, &grads));
  lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
  CHECK_LWO(lwo_grads_tensor(grads, 1, "bias", &gt));
  ASSERT_EQ(64u, gt.n_elements);
  const float* host = static_cast<const float*>(gt.data);
  // The gradient of layer 1: zeros, written behind a 200 ms kernel so the
  // copy cannot have landed when the host looks.
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_grads_begin(grads, 1, stream(0), &v));
  CUDA_OK(lwo::kernels::spin_async(200000, stream(0)));
  CUDA_OK(cudaMemsetAsync(v.base, 0, v.record_bytes, stream(0)));
  CHECK_LWO(lwo_grads_end(grads, 1, stream(0)));
  for (uint64_t i = 0; i < gt.n_elements; ++i)
    ASSERT_TRUE(std::isnan(host[i])) << "element " << i << " before the fence: " << host[i];
  CHECK_LWO(lwo_grads_wait(grads));
  for (uint64_t i = 0; i < gt.n_elements; ++i) ASSERT_EQ(0.0f, host[i]) << "element " << i;
  // A layer with no gradient reads zero after the fence.
  lwo_grad_tensor g0 = LWO_GRAD_TENSOR_INIT;
  CHECK_LWO(lwo_grads_tensor(grads, 0, "bias", &g0));
  EXPECT_EQ(0.0f, static_cast<const float*>(g0.data)[0]);
  // After a zero, the old sums are gone before the fence.
  CHECK_LWO(lwo_grads_zero(grads));
  EXPECT_TRUE(std::isnan(host[0]));
  CHECK_LWO(lwo_grads_wait(grads));
  EXPECT_EQ(0.0f, host[0]);
  CHECK_LWO(lwo_grads_destroy(grads));
}

}  // namespace
}  // namespace lwo_test
