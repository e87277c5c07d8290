// lwo_nccl_comm_split on one GPU: a communicator of the caller's own (made
// with NCCL directly, as PyTorch's ProcessGroupNCCL makes one) is split into
// lwo's private child; a sharded pool streams exactly its records and sums
// its gradients through the child; lwo never destroys the parent, and the
// caller's own collectives on the parent still work after the split.
#include <nccl.h>

#include "gpu_util.h"

namespace lwo_test {
namespace {

#define NCCL_OK(expr)                                                       \
  do {                                                                      \
    ncclResult_t r_ = (expr);                                               \
    ASSERT_EQ(r_, ncclSuccess) << #expr << ": " << ncclGetErrorString(r_); \
  } while (0)

using CommSplit = GpuTest;

TEST_F(CommSplit, AChildOfTheCallersCommunicatorStreamsAShardedPool) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  int dev = 0;
  ncclComm_t parent = nullptr;
  NCCL_OK(ncclCommInitAll(&parent, 1, &dev));
  auto parent_guard = defer([&] { EXPECT_EQ(ncclCommDestroy(parent), ncclSuccess); });
  lwo_nccl_comm_t child = nullptr;
  CHECK_LWO(lwo_nccl_comm_split(engine_, parent, 0, 0, &child));
  ASSERT_NE(child, nullptr);
  ASSERT_NE(static_cast<void*>(child), static_cast<void*>(parent));
  // The parent is the caller's: lwo refuses to destroy it.
  EXPECT_EQ(lwo_nccl_comm_destroy(parent), LWO_ERR_INVALID_HANDLE);
  {
    auto child_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(child)); });

    constexpr uint32_t L = 4;
    std::vector<lwo_tensor_desc> td(L);
    std::vector<lwo_layer_desc> ld(L);
    std::vector<std::vector<uint8_t>> w(L), rec(L);
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t rows = 100 + 37 * l;
      td[l] = tensor_desc("w", LWO_DTYPE_F32, {rows, 512});
      ld[l] = lwo_layer_desc{&td[l], 1, nullptr};
      w[l].resize(static_cast<size_t>(rows) * 512 * 4);
      fill_random(w[l].data(), w[l].size(), test_seed(7) + l);
      rec[l].assign((w[l].size() + 255) / 256 * 256, 0);
      std::memcpy(rec[l].data(), w[l].data(), w[l].size());
    }
    lwo_pool* pool = nullptr;
    CHECK_LWO(lwo_pool_create_sharded(engine_, ld.data(), L, child, nullptr, &pool));
    auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
    for (uint32_t l = 0; l < L; ++l)
      CHECK_LWO(lwo_pool_write(pool, l, "w", w[l].data(), w[l].size()));

    Ring ring;
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = 2;
    CHECK_LWO(lwo_ring_create(pool, &rc, ring.out()));
    std::vector<uint8_t> back;
    for (uint32_t l : {0u, 1u, 2u, 3u, 1u}) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, stream(0), &t, &v));
      ASSERT_EQ(v.record_bytes, rec[l].size());
      back.assign(rec[l].size(), 0xEE);
      CUDA_OK(cudaMemcpyAsync(back.data(), v.base, back.size(), cudaMemcpyDeviceToHost, stream(0)));
      CUDA_OK(cudaStreamSynchronize(stream(0)));
      EXPECT_EQ(std::memcmp(back.data(), rec[l].data(), back.size()), 0) << "layer " << l;
      CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
    }

    // Gradients through the child: one rank's sum is its own gradient.
    lwo_grads* grads = nullptr;
    CHECK_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
    auto grads_guard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
    lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_grads_begin(grads, 2, stream(0), &gv));
    const size_t n = w[2].size() / 4;
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = 0.5f * static_cast<float>(i % 97) - 3.0f;
    CUDA_OK(cudaMemcpyAsync(gv.tensors[0], g.data(), n * 4, cudaMemcpyHostToDevice, stream(0)));
    CHECK_LWO(lwo_grads_end(grads, 2, stream(0)));
    CHECK_LWO(lwo_grads_wait(grads));
    float* hg = nullptr;
    uint64_t first = 1, count = 0;
    CHECK_LWO(lwo_grads_shard(grads, 2, "w", &hg, &first, &count));
    EXPECT_EQ(first, 0u);
    ASSERT_EQ(count, n);
    EXPECT_EQ(std::memcmp(hg, g.data(), n * 4), 0);
  }
  // The caller's own collective on the parent still runs.
  float* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 4 * sizeof(float)));
  auto d_guard = defer([&] { cudaFree(d); });
  const float ones[4] = {1, 1, 1, 1};
  CUDA_OK(cudaMemcpy(d, ones, sizeof ones, cudaMemcpyHostToDevice));
  NCCL_OK(ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, parent, stream(0)));
  CUDA_OK(cudaStreamSynchronize(stream(0)));
  float out[4] = {};
  CUDA_OK(cudaMemcpy(out, d, sizeof out, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out[3], 1.0f);
}

TEST_F(CommSplit, ANegativeColorAndANullParentAreRefused) {
  int dev = 0;
  ncclComm_t parent = nullptr;
  NCCL_OK(ncclCommInitAll(&parent, 1, &dev));
  auto parent_guard = defer([&] { EXPECT_EQ(ncclCommDestroy(parent), ncclSuccess); });
  lwo_nccl_comm_t child = nullptr;
  EXPECT_EQ(lwo_nccl_comm_split(engine_, parent, -1, 0, &child), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(child, nullptr);
  EXPECT_EQ(lwo_nccl_comm_split(engine_, nullptr, 0, 0, &child), LWO_ERR_INVALID_ARGUMENT);
  // The parent is still good: a split after the refusals works.
  CHECK_LWO(lwo_nccl_comm_split(engine_, parent, 5, 0, &child));
  EXPECT_LWO_OK(lwo_nccl_comm_destroy(child));
}

}  // namespace
}  // namespace lwo_test
