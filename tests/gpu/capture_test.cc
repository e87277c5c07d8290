// CUDA graphs of a ring's passes on the GPU (lwo_ring_capture_begin / _end,
// lwo_graph_launch / _destroy): a forward pass of a chain of linear layers
// (stage, acquire, lwo_linear_forward, release per layer, a ring shallower
// than the chain) captured once and replayed equals the same chain computed
// from resident copies of the weights bit for bit; a layer rewritten in the
// pool between replays is seen by the next one; replays on two streams in a
// row are ordered by the library; the ring belongs to the graph until it is
// destroyed, then an eager pass equals the resident chain again.
#include <random>

#include "quant_util.h"

namespace lwo_test {
namespace {

constexpr int64_t kDim = 256;
constexpr int64_t kTokens = 64;
constexpr uint32_t kLayers = 6;

class CaptureGpu : public GpuTest {};

lwo_linear_desc linear_desc() {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_BF16;
  d.in_features = d.out_features = kDim;
  d.flags = LWO_LINEAR_BIAS;
  return d;
}

TEST_F(CaptureGpu, ReplayedForwardEqualsTheResidentChainAndSeesPoolChanges) {
  std::mt19937_64 rng(fresh_seed() + 77);
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  const size_t es = 2, NW = size_t(kDim * kDim), NB = size_t(kDim);
  const size_t act = size_t(kTokens * kDim) * es;
  lwo_tensor_desc t[2] = {tensor_desc("weight", DT, {kDim, kDim}), tensor_desc("bias", DT, {kDim})};
  std::vector<lwo_layer_desc> layers(kLayers, lwo_layer_desc{t, 2, nullptr});
  testkit::Pool pool;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), kLayers, nullptr, pool.out()));
  std::vector<HostMat> W, B;
  for (uint32_t l = 0; l < kLayers; ++l) {
    W.push_back(random_mat(DT, NW, 0.12f, rng));
    B.push_back(random_mat(DT, NB, 0.1f, rng));
    CHECK_LWO(lwo_pool_write(pool.get(), l, "weight", W[l].bytes.data(), W[l].bytes.size()));
    CHECK_LWO(lwo_pool_write(pool.get(), l, "bias", B[l].bytes.data(), B[l].bytes.size()));
  }
  Ring ring;
  create_ring(pool.get(), 2, 0, &ring);
  if (HasFatalFailure()) return;
  const lwo_linear_desc d = linear_desc();
  const cudaStream_t st = stream(0), st2 = stream(1);
  const HostMat x = random_mat(DT, size_t(kTokens * kDim), 1.f, rng);
  testkit::DeviceMem X0 = upload(x.bytes);
  std::vector<testkit::DeviceMem> X;
  for (uint32_t l = 0; l < kLayers; ++l) X.push_back(poisoned(act));
  // The chain from resident weights: what every pass must give.
  auto resident = [&]() {
    std::vector<testkit::DeviceMem> Y;
    for (uint32_t l = 0; l < kLayers; ++l) {
      testkit::DeviceMem w = upload(W[l].bytes), b = upload(B[l].bytes);
      Y.push_back(poisoned(act));
      EXPECT_LWO_OK(lwo_linear_forward(engine_, &d, kTokens, l ? Y[l - 1].get() : X0.get(),
                                       w.get(), b.get(), Y[l].get(), st));
      EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
    }
    return fetch(Y[kLayers - 1], act);
  };
  // One streamed pass enqueued on `s` (eager, or captured).
  auto pass = [&](cudaStream_t s) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      lwo_ticket tk{};
      CHECK_LWO(lwo_ring_stage(ring.get(), l, &tk));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_ring_acquire(ring.get(), tk, s, &v));
      CHECK_LWO(lwo_linear_forward(engine_, &d, kTokens, l ? X[l - 1].get() : X0.get(),
                                   v.tensors[0], v.tensors[1], X[l].get(), s));
      CHECK_LWO(lwo_ring_release(ring.get(), tk, s));
    }
  };
  const std::vector<uint8_t> want = resident();
  pass(st);  // eager first: the compute's plans are made outside the capture
  CUDA_OK(cudaStreamSynchronize(st));
  ASSERT_EQ(fetch(X[kLayers - 1], act), want) << "eager pass";

  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  pass(st);
  lwo_graph* graph = nullptr;
  CHECK_LWO(lwo_ring_capture_end(ring.get(), st, &graph));
  ASSERT_NE(graph, nullptr);
  auto destroy_graph = defer([&] {
    if (graph) EXPECT_LWO_OK(lwo_graph_destroy(graph));
  });
  for (testkit::DeviceMem& m : X) CUDA_OK(cudaMemset(m.get(), 0xff, act));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK_LWO(lwo_graph_launch(graph, st));
  CUDA_OK(cudaStreamSynchronize(st));
  ASSERT_EQ(fetch(X[kLayers - 1], act), want) << "first replay";

  // Layer 2 rewritten in the pool: the next replay moves the new bytes.
  W[2] = random_mat(DT, NW, 0.12f, rng);
  CHECK_LWO(lwo_pool_write(pool.get(), 2, "weight", W[2].bytes.data(), W[2].bytes.size()));
  const std::vector<uint8_t> want2 = resident();
  ASSERT_NE(want2, want);
  CHECK_LWO(lwo_graph_launch(graph, st));
  CUDA_OK(cudaStreamSynchronize(st));
  ASSERT_EQ(fetch(X[kLayers - 1], act), want2) << "replay after the pool changed";

  // Two replays in a row on two streams, the first held back by a delay:
  // the second waits for the first (they share the slots and buffers).
  CUDA_OK(stream_delay(st, 20000));
  CHECK_LWO(lwo_graph_launch(graph, st));
  CHECK_LWO(lwo_graph_launch(graph, st2));
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(fetch(X[kLayers - 1], act), want2) << "replays on two streams";

  // The ring belongs to the graph.
  lwo_ticket tk{};
  EXPECT_EQ(lwo_ring_stage(ring.get(), 0, &tk), LWO_ERR_BUSY) << lwo_last_error_message();
  EXPECT_EQ(lwo_ring_destroy(ring.get()), LWO_ERR_BUSY);
  CHECK_LWO(lwo_graph_destroy(graph));
  graph = nullptr;
  // Given back: an eager pass equals the resident chain.
  for (testkit::DeviceMem& m : X) CUDA_OK(cudaMemset(m.get(), 0xff, act));
  CUDA_OK(cudaDeviceSynchronize());
  pass(st);
  CUDA_OK(cudaStreamSynchronize(st));
  ASSERT_EQ(fetch(X[kLayers - 1], act), want2) << "eager pass after the graph";
}

// During a capture, calls that wait or query are LWO_ERR_CAPTURING, and a
// capture discarded for a live ticket leaves the ring and the stream usable.
TEST_F(CaptureGpu, RefusalsDuringACaptureLeaveTheStreamUsable) {
  lwo_tensor_desc t[1] = {tensor_desc("w", LWO_DTYPE_F32, {256, 64})};
  std::vector<lwo_layer_desc> layers(3, lwo_layer_desc{t, 1, nullptr});
  testkit::Pool pool;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), 3, nullptr, pool.out()));
  Ring ring;
  create_ring(pool.get(), 2, 0, &ring);
  if (HasFatalFailure()) return;
  const cudaStream_t st = stream(0);
  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  lwo_ticket tk{};
  CHECK_LWO(lwo_ring_stage(ring.get(), 0, &tk));
  uint32_t landed = 7;
  EXPECT_EQ(lwo_ring_query(ring.get(), tk, &landed), LWO_ERR_CAPTURING);
  EXPECT_EQ(lwo_engine_synchronize(engine_), LWO_ERR_CAPTURING);
  lwo_graph* graph = nullptr;
  EXPECT_EQ(lwo_ring_capture_end(ring.get(), st, &graph), LWO_ERR_TICKET_STATE);
  EXPECT_EQ(graph, nullptr);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CUDA_OK(cudaStreamIsCapturing(st, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  CHECK_LWO(lwo_engine_synchronize(engine_));
  // The ring stages eagerly again, and the slot holds the layer's bytes.
  void* host = nullptr;
  uint64_t bytes = 0;
  CHECK_LWO(lwo_pool_layer_host(pool.get(), 1, &host, &bytes));
  fill_random(host, bytes, 99);
  CHECK_LWO(lwo_ring_stage(ring.get(), 1, &tk));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_ring_acquire(ring.get(), tk, st, &v));
  std::vector<uint8_t> got(bytes);
  CUDA_OK(cudaMemcpyAsync(got.data(), v.base, bytes, cudaMemcpyDeviceToHost, st));
  CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
  CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_EQ(0, std::memcmp(got.data(), host, bytes));
}

}  // namespace
}  // namespace lwo_test
