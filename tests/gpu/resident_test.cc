// Resident layers and the device memory budget on the GPU:
// resident and streamed layers hold exactly the host bytes; a changed
// resident layer is uploaded again, and only after a slow reader of its old
// bytes is done; a trainable resident layer's gradients equal a streamed
// layer's and a plain device copy's bit for bit; the budget counts what the
// ring, the gradients and the compute workspaces allocate.
#include "gpu_util.h"
#include "testkit/spin.h"

namespace lwo_test {
namespace {

class Resident : public GpuTest {
 protected:
  // A pinned pool of `n` layers, layer i a bf16 "weight" of (i % 4 + 1) * 64
  // x 96 and an f32 "bias", filled with random bytes.
  lwo_pool* make_pool(uint32_t n, uint64_t seed) {
    descs_.assign(n, {});
    layers_.assign(n, {});
    for (uint32_t i = 0; i < n; ++i) {
      const lwo_tensor_desc w = tensor_desc("weight", LWO_DTYPE_BF16, {(i % 4 + 1) * 64, 96});
      const lwo_tensor_desc b = tensor_desc("bias", LWO_DTYPE_F32, {w.shape[0]});
      descs_[i] = {w, b};
      layers_[i] = lwo_layer_desc{descs_[i].data(), 2, nullptr};
    }
    lwo_pool* pool = nullptr;
    EXPECT_EQ(LWO_OK, lwo_pool_create_pinned(engine_, layers_.data(), n, nullptr, &pool))
        << lwo_last_error_message();
    for (uint32_t i = 0; pool && i < n; ++i) randomize(pool, i, seed * 100 + i);
    return pool;
  }
  void randomize(lwo_pool* pool, uint32_t layer, uint64_t seed) {
    void* p = nullptr;
    uint64_t bytes = 0;
    ASSERT_EQ(LWO_OK, lwo_pool_layer_host(pool, layer, &p, &bytes));
    std::mt19937_64 rng(seed);
    auto* b = static_cast<uint8_t*>(p);
    for (uint64_t i = 0; i < bytes; ++i) b[i] = static_cast<uint8_t>(rng() >> 13);
  }
  std::vector<uint8_t> host_bytes(lwo_pool* pool, uint32_t layer) {
    void* p = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(LWO_OK, lwo_pool_layer_host(pool, layer, &p, &bytes));
    return std::vector<uint8_t>(static_cast<uint8_t*>(p), static_cast<uint8_t*>(p) + bytes);
  }
  lwo_ring* make_ring(lwo_pool* pool, uint32_t depth, std::vector<uint32_t> resident) {
    lwo_ring_config c = LWO_RING_CONFIG_INIT;
    c.depth = depth;
    c.resident_layers = resident.data();
    c.n_resident = static_cast<uint32_t>(resident.size());
    lwo_ring* ring = nullptr;
    EXPECT_EQ(LWO_OK, lwo_ring_create(pool, &c, &ring)) << lwo_last_error_message();
    return ring;
  }
  // Stages, acquires on `st`, copies the record back to the host (on `st`,
  // after `spin_us` of spinning there), releases; returns the bytes read.
  std::vector<uint8_t> read_back(lwo_ring* ring, uint32_t layer, cudaStream_t st,
                                 unsigned spin_us = 0) {
    lwo_ticket t{0};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    EXPECT_EQ(LWO_OK, lwo_ring_stage(ring, layer, &t)) << lwo_last_error_message();
    EXPECT_EQ(LWO_OK, lwo_ring_acquire(ring, t, st, &v)) << lwo_last_error_message();
    if (spin_us) {
      EXPECT_EQ(cudaSuccess, lwo::kernels::spin_async(spin_us, st));
    }
    std::vector<uint8_t> out(v.record_bytes);
    EXPECT_EQ(cudaSuccess, cudaMemcpyAsync(out.data(), v.base, v.record_bytes,
                                           cudaMemcpyDeviceToHost, st));
    EXPECT_EQ(LWO_OK, lwo_ring_release(ring, t, st)) << lwo_last_error_message();
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
    return out;
  }
  lwo_ring_stats stats(lwo_ring* ring) {
    lwo_ring_stats s{};
    s.size = sizeof s;
    EXPECT_EQ(LWO_OK, lwo_ring_get_stats(ring, &s));
    return s;
  }

  std::vector<std::vector<lwo_tensor_desc>> descs_;
  std::vector<lwo_layer_desc> layers_;
};

// Resident and streamed layers read back exactly their host bytes, pass after
// pass on two streams; resident layers are hits that move no byte; a changed
// resident layer is uploaded again and reads back its new bytes.
TEST_F(Resident, ResidentAndStreamedEqualHostBytes) {
  const uint32_t L = 8;
  lwo_pool* pool = make_pool(L, test_seed(31));
  auto pg = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  lwo_ring* ring = make_ring(pool, 2, {1, 3, 7});
  ASSERT_NE(nullptr, ring);
  auto rg = defer([&] { EXPECT_LWO_OK(lwo_ring_destroy(ring)); });
  lwo_ring_stats s0 = stats(ring);
  EXPECT_EQ(3u, s0.n_resident_uploads);
  CHECK_LWO(lwo_ring_reset_stats(ring));
  for (int pass = 0; pass < 3; ++pass)
    for (uint32_t l = 0; l < L; ++l)
      ASSERT_EQ(host_bytes(pool, l), read_back(ring, l, stream(pass % 2)))
          << "layer " << l << " pass " << pass;
  lwo_ring_stats s = stats(ring);
  EXPECT_EQ(9u, s.n_resident_hits);
  EXPECT_EQ(0u, s.n_resident_uploads);
  uint64_t streamed = 0;
  for (uint32_t l : {0u, 2u, 4u, 5u, 6u}) streamed += host_bytes(pool, l).size();
  EXPECT_EQ(3 * streamed, s.bytes_copied);  // no resident byte moved

  randomize(pool, 3, test_seed(32));
  CHECK_LWO(lwo_pool_layer_changed(pool, 3));
  ASSERT_EQ(host_bytes(pool, 3), read_back(ring, 3, stream(0)));
  EXPECT_EQ(1u, stats(ring).n_resident_uploads);
  ASSERT_EQ(host_bytes(pool, 3), read_back(ring, 3, stream(1)));
  EXPECT_EQ(1u, stats(ring).n_resident_uploads);  // a hit again
}

// A reader still spinning on the old bytes of a resident layer when the
// layer changes and is staged again: its copy-out sees the old bytes (the
// upload waited for its release), the next reader sees the new ones.
TEST_F(Resident, ReuploadWaitsForEveryReaderOfTheOldBytes) {
  lwo_pool* pool = make_pool(3, test_seed(41));
  auto pg = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  lwo_ring* ring = make_ring(pool, 1, {2});
  ASSERT_NE(nullptr, ring);
  auto rg = defer([&] { EXPECT_LWO_OK(lwo_ring_destroy(ring)); });
  std::vector<uint8_t> old_bytes = host_bytes(pool, 2);
  // Pinned host memory so the copy-out is asynchronous behind the spin.
  uint64_t bytes = old_bytes.size();
  void* out = nullptr;
  CUDA_OK(cudaMallocHost(&out, bytes));
  auto og = defer([&] { cudaFreeHost(out); });
  std::memset(out, 0, bytes);
  lwo_ticket t{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring, 2, stream(0), &t, &v));
  CUDA_OK(lwo::kernels::spin_async(300000, stream(0)));  // 300 ms
  CUDA_OK(cudaMemcpyAsync(out, v.base, bytes, cudaMemcpyDeviceToHost, stream(0)));
  CHECK_LWO(lwo_ring_release(ring, t, stream(0)));
  // The host changes the layer and stages it again at once (the reader still spins).
  randomize(pool, 2, test_seed(42));
  CHECK_LWO(lwo_pool_layer_changed(pool, 2));
  std::vector<uint8_t> new_bytes = host_bytes(pool, 2);
  ASSERT_NE(old_bytes, new_bytes);
  CHECK_LWO(lwo_ring_stage(ring, 2, &t));
  CHECK_LWO(lwo_ring_acquire(ring, t, stream(1), &v));
  std::vector<uint8_t> now(bytes);
  CUDA_OK(cudaMemcpyAsync(now.data(), v.base, bytes, cudaMemcpyDeviceToHost, stream(1)));
  CHECK_LWO(lwo_ring_release(ring, t, stream(1)));
  CUDA_OK(cudaStreamSynchronize(stream(0)));
  CUDA_OK(cudaStreamSynchronize(stream(1)));
  EXPECT_EQ(0, std::memcmp(out, old_bytes.data(), bytes)) << "the upload overwrote a reader";
  EXPECT_EQ(new_bytes, now);
  EXPECT_EQ(1u + 1u, stats(ring).n_resident_uploads);
}

// A trainable linear layer kept resident: forward output and the weight
// gradient that reaches the host through lwo_grads equal, bit for bit, a
// streamed ring's and a plain device copy's of the same weights.
TEST_F(Resident, TrainableResidentLayerGradientsMatchStreamed) {
  const int64_t T = 128, IN = 96, OUT = 64;
  std::mt19937_64 rng(test_seed(51));
  // Two layers of the same shape; layer 0 is the one checked.
  std::vector<lwo_tensor_desc> td(2);
  for (auto& t : td) t = tensor_desc("weight", LWO_DTYPE_F32, {OUT, IN});
  lwo_layer_desc ld[2] = {{&td[0], 1, nullptr}, {&td[1], 1, nullptr}};
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, ld, 2, nullptr, &pool));
  auto pg = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (uint32_t l = 0; l < 2; ++l) {
    void* p = nullptr;
    uint64_t b = 0;
    CHECK_LWO(lwo_pool_layer_host(pool, l, &p, &b));
    for (uint64_t i = 0; i < b / 4; ++i) static_cast<float*>(p)[i] = u(rng);
  }
  std::vector<float> xh(T * IN), dyh(T * OUT);
  for (float& f : xh) f = u(rng);
  for (float& f : dyh) f = u(rng);
  testkit::DeviceMem x, dy, y, wplain;
  CUDA_OK(cudaMalloc(x.out(), xh.size() * 4));
  CUDA_OK(cudaMalloc(dy.out(), dyh.size() * 4));
  CUDA_OK(cudaMalloc(y.out(), T * OUT * 4));
  CUDA_OK(cudaMalloc(wplain.out(), OUT * IN * 4));
  CUDA_OK(cudaMemcpy(x.get(), xh.data(), xh.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dy.get(), dyh.data(), dyh.size() * 4, cudaMemcpyHostToDevice));
  void* w0 = nullptr;
  uint64_t wb = 0;
  CHECK_LWO(lwo_pool_layer_host(pool, 0, &w0, &wb));
  CUDA_OK(cudaMemcpy(wplain.get(), w0, OUT * IN * 4, cudaMemcpyHostToDevice));
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_F32;
  d.in_features = IN;
  d.out_features = OUT;
  cudaStream_t st = stream(0);

  // The reference: the plain copy's forward and weight gradient.
  std::vector<uint8_t> y_ref(T * OUT * 4), g_ref(OUT * IN * 4);
  {
    testkit::DeviceMem g;
    CUDA_OK(cudaMalloc(g.out(), g_ref.size()));
    CHECK_LWO(lwo_linear_forward(engine_, &d, T, x.get(), wplain.get(), nullptr, y.get(), st));
    CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.get(), dy.get(), nullptr, nullptr, g.get(),
                                  nullptr, LWO_DTYPE_F32, st));
    CUDA_OK(cudaMemcpyAsync(y_ref.data(), y.get(), y_ref.size(), cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaMemcpyAsync(g_ref.data(), g.get(), g_ref.size(), cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaStreamSynchronize(st));
  }
  for (bool resident : {true, false}) {
    lwo_ring* ring = make_ring(pool, 1, resident ? std::vector<uint32_t>{0} : std::vector<uint32_t>{});
    ASSERT_NE(nullptr, ring);
    auto rg = defer([&] { EXPECT_LWO_OK(lwo_ring_destroy(ring)); });
    lwo_grads* grads = nullptr;
    CHECK_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
    auto gg = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
    for (int step = 0; step < 2; ++step) {
      CHECK_LWO(lwo_grads_zero(grads));
      // Forward over both layers, then backward of layer 0 (layer 1 between
      // them keeps the depth-1 ring streaming).
      std::vector<uint8_t> y_got(T * OUT * 4);
      const uint32_t order[3] = {0, 1, 0};
      for (int pos = 0; pos < 3; ++pos) {
        uint32_t l = order[pos];
        lwo_ticket t{0};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring, l, st, &t, &v));
        if (pos == 0) {
          CHECK_LWO(lwo_linear_forward(engine_, &d, T, x.get(), v.tensors[0], nullptr, y.get(), st));
          CUDA_OK(cudaMemcpyAsync(y_got.data(), y.get(), y_got.size(), cudaMemcpyDeviceToHost, st));
          CUDA_OK(cudaStreamSynchronize(st));
        } else if (pos == 2) {
          lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
          CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
          CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.get(), dy.get(), v.tensors[0], nullptr,
                                        gv.tensors[0], nullptr, LWO_DTYPE_F32, st));
          CHECK_LWO(lwo_grads_end(grads, 0, st));
        }
        CHECK_LWO(lwo_ring_release(ring, t, st));
      }
      CHECK_LWO(lwo_grads_wait(grads));
      EXPECT_EQ(y_ref, y_got) << (resident ? "resident" : "streamed") << " step " << step;
      float* h = nullptr;
      uint64_t first = 0, n = 0;
      CHECK_LWO(lwo_grads_shard(grads, 0, "weight", &h, &first, &n));
      ASSERT_EQ(uint64_t(OUT * IN), n);
      EXPECT_EQ(0, std::memcmp(h, g_ref.data(), g_ref.size()))
          << (resident ? "resident" : "streamed") << " step " << step;
    }
    lwo_ring_stats s = stats(ring);
    EXPECT_EQ(resident ? 4u : 0u, s.n_resident_hits);
  }
}

// The budget on the device: a ring that does not fit is refused with the
// bytes it needs; what fits is reported by lwo_engine_get_memory, compute
// workspaces included; destroying gives everything back.
TEST_F(Resident, BudgetCountsRingResidentGradsAndWorkspaces) {
  lwo_pool* pool = make_pool(4, test_seed(61));
  auto pg = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  CHECK_LWO(lwo_engine_get_memory(engine_, &m));
  EXPECT_GT(m.device_total, 0u);
  EXPECT_GT(m.device_free, 0u);
  uint64_t base = m.used;  // what earlier calls of this engine hold (none so far)
  CHECK_LWO(lwo_engine_set_budget(engine_, base + (uint64_t(64) << 10), 0.0, 0));
  // Four slots of the largest record (about 49 KiB each) do not fit in 64 KiB.
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 4;
  lwo_ring* ring = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_OVER_BUDGET, "lwo_ring_create", lwo_ring_create(pool, &c, &ring));
  EXPECT_NE(std::string::npos, std::string(lwo_last_error_message()).find("left"));
  CHECK_LWO(lwo_engine_set_budget(engine_, 0, 0.5, 0));
  CHECK_LWO(lwo_engine_get_memory(engine_, &m));
  EXPECT_GT(m.budget, 0u);
  EXPECT_LE(m.budget, m.device_free / 2 + m.used + 1);
  ring = make_ring(pool, 2, {3});
  ASSERT_NE(nullptr, ring);
  auto rg = defer([&] { EXPECT_LWO_OK(lwo_ring_destroy(ring)); });
  CHECK_LWO(lwo_engine_get_memory(engine_, &m));
  EXPECT_EQ(2u * 512u * ((host_bytes(pool, 2).size() + 511) / 512), m.ring_slots);
  EXPECT_EQ(512u * ((host_bytes(pool, 3).size() + 511) / 512), m.resident);
  // A compute call makes its stream's workspace: it counts.
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_F32;
  d.in_features = 32;
  d.out_features = 32;
  testkit::DeviceMem x, w, y;
  CUDA_OK(cudaMalloc(x.out(), 32 * 32 * 4));
  CUDA_OK(cudaMalloc(w.out(), 32 * 32 * 4));
  CUDA_OK(cudaMalloc(y.out(), 32 * 32 * 4));
  CUDA_OK(cudaMemset(x.get(), 0, 32 * 32 * 4));
  CUDA_OK(cudaMemset(w.get(), 0, 32 * 32 * 4));
  CHECK_LWO(lwo_linear_forward(engine_, &d, 32, x.get(), w.get(), nullptr, y.get(), stream(0)));
  CUDA_OK(cudaStreamSynchronize(stream(0)));
  CHECK_LWO(lwo_engine_get_memory(engine_, &m));
  EXPECT_GT(m.workspaces, 0u);
  EXPECT_EQ(m.ring_slots + m.resident + m.grads + m.workspaces, m.used);
  EXPECT_EQ(m.budget - m.used, m.left);
}

}  // namespace
}  // namespace lwo_test
