// Registered pools on the device: caller memory laid out with
// lwo_record_layout moves in one copy per layer; scattered tensors move in one
// copy per contiguous run; the slot holds exactly the caller's bytes.
#include "gpu/gpu_util.h"

namespace lwo_test {
namespace {

std::string read_only_support() {
  int v = -1;
  cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrHostRegisterReadOnlySupported, 0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return "cudaDevAttrHostRegisterReadOnlySupported: query failed";
  }
  return "cudaDevAttrHostRegisterReadOnlySupported = " + std::to_string(v);
}

cudaMemoryType host_memory_type(const void* p) {
  cudaPointerAttributes a;
  std::memset(&a, 0, sizeof a);
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaMemoryTypeUnregistered;
  }
  return a.type;
}

// Stages every layer once into a ring deep enough to hold them all, checking
// per layer that one miss takes the expected copies and bytes and that the
// slot equals the host bytes; then a second round of pure hits.
void stage_every_layer(lwo_ring* ring, const TestPool& tp, cudaStream_t stream, Checks* checks) {
  for (uint32_t l = 0; l < tp.n_layers(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    lwo_ring_stats before = ring_stats(ring);
    ASSERT_NO_FATAL_FAILURE(round_trip(ring, tp, l, stream, checks, "first copy"));
    lwo_ring_stats after = ring_stats(ring);
    EXPECT_EQ(before.n_hits, after.n_hits);
    EXPECT_EQ(before.n_copies + tp.layers[l].copy_runs, after.n_copies);
    EXPECT_EQ(before.bytes_copied + tp.layers[l].copy_bytes, after.bytes_copied);
  }
  lwo_ring_stats before = ring_stats(ring);
  for (uint32_t l = 0; l < tp.n_layers(); ++l)
    ASSERT_NO_FATAL_FAILURE(round_trip(ring, tp, l, stream, checks, "hit"));
  lwo_ring_stats after = ring_stats(ring);
  EXPECT_EQ(before.n_hits + tp.n_layers(), after.n_hits);
  EXPECT_EQ(before.n_copies, after.n_copies);
  EXPECT_EQ(before.bytes_copied, after.bytes_copied);
}

TEST_F(GpuTest, RegisteredContiguousLayersMoveInOneCopy) {
  SCOPED_TRACE(read_only_support());
  std::printf("[ register ] %s\n", read_only_support().c_str());
  const uint64_t seed = test_seed(0x4E6u);
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_registered_pool(
      engine_, random_layer_specs(seed, 7, 3, uint64_t(1) << 20, 4), seed, Placement::kContiguous,
      &tp));
  uint64_t runs = 0, bytes = 0;
  for (uint32_t l = 0; l < tp.n_layers(); ++l) {
    const LayerRef& lr = tp.layers[l];
    bool empty = true;
    for (const TensorRef& t : lr.tensors) empty = empty && t.bytes == 0;
    EXPECT_EQ(empty ? 0u : 1u, lr.copy_runs) << "layer " << l << " is laid out as its record";
    EXPECT_TRUE(lr.whole_check) << "layer " << l;
    runs += lr.copy_runs;
    bytes += lr.copy_bytes;
  }
  {
    lwo_pool_info info;
    std::memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK_LWO(lwo_pool_get_info(tp.pool, &info));
    EXPECT_EQ(LWO_POOL_REGISTERED, info.kind);
  }
  // Registered pools are the caller's memory: no lwo_pool_write.
  {
    const TensorRef& t = tp.layers[0].tensors[0];
    std::vector<uint8_t> src(t.bytes + 1);
    EXPECT_LWO_ERR(LWO_ERR_UNSUPPORTED, "lwo_pool_write",
                   lwo_pool_write(tp.pool, 0, t.name.c_str(), src.data(), t.bytes));
  }
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(256));
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, tp.n_layers(), 0, &ring));
  EXPECT_EQ(tp.max_record, ring_info(ring.get()).slot_bytes);
  ASSERT_NO_FATAL_FAILURE(stage_every_layer(ring.get(), tp, stream(0), &checks));
  lwo_ring_stats st = ring_stats(ring.get());
  EXPECT_EQ(runs, st.n_copies) << "one copy per non-empty layer";
  EXPECT_EQ(bytes, st.bytes_copied);
  CHECK_LWO(ring.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

TEST_F(GpuTest, RegisteredScatteredTensorsMoveInSeveralCopies) {
  SCOPED_TRACE(read_only_support());
  const uint64_t seed = test_seed(0x5CA7u);
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_registered_pool(
      engine_, random_layer_specs(seed, 6, 1, uint64_t(512) << 10, 5), seed, Placement::kScattered,
      &tp));
  uint64_t runs = 0;
  bool some_layer_several = false;
  for (uint32_t l = 0; l < tp.n_layers(); ++l) {
    uint32_t nonempty = 0;
    for (const TensorRef& t : tp.layers[l].tensors) nonempty += t.bytes > 0;
    EXPECT_EQ(nonempty, tp.layers[l].copy_runs) << "layer " << l << ": one copy per tensor";
    some_layer_several = some_layer_several || nonempty > 1;
    runs += tp.layers[l].copy_runs;
  }
  EXPECT_TRUE(some_layer_several) << "the random layers should include multi-tensor ones";
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(512));
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, tp.n_layers(), 0, &ring));
  ASSERT_NO_FATAL_FAILURE(stage_every_layer(ring.get(), tp, stream(1), &checks));
  EXPECT_EQ(runs, ring_stats(ring.get()).n_copies);
  CHECK_LWO(ring.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

TEST_F(GpuTest, RegisteredMixedPlacementCopyPlan) {
  SCOPED_TRACE(read_only_support());
  for (uint64_t round = 0; round < 3; ++round) {
    const uint64_t seed = test_seed(0x313u + round);
    SCOPED_TRACE("seed " + std::to_string(seed));
    TestPool tp;
    ASSERT_NO_FATAL_FAILURE(create_registered_pool(
        engine_, random_layer_specs(seed, 8, 2, uint64_t(256) << 10, 5), seed, Placement::kMixed,
        &tp));
    Checks checks;
    ASSERT_NO_FATAL_FAILURE(checks.init(1024));
    // Depth 1: every layer evicts the previous one; per-layer deltas still exact.
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 1, 0, &ring));
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t l = 0; l < tp.n_layers(); ++l) {
        SCOPED_TRACE("layer " + std::to_string(l));
        lwo_ring_stats before = ring_stats(ring.get());
        ASSERT_NO_FATAL_FAILURE(round_trip(ring.get(), tp, l, stream(pass), &checks, "mixed"));
        lwo_ring_stats after = ring_stats(ring.get());
        EXPECT_EQ(before.n_copies + tp.layers[l].copy_runs, after.n_copies);
        EXPECT_EQ(before.bytes_copied + tp.layers[l].copy_bytes, after.bytes_copied);
      }
    }
    CHECK_LWO(ring.reset());
    checks.verify();
    CHECK_LWO(tp.destroy());
  }
}

// The pool registers caller memory for DMA while it lives, unregisters it when
// destroyed, and never writes to it.
TEST_F(GpuTest, RegisteredMemoryIsRegisteredOnlyWhileThePoolLives) {
  SCOPED_TRACE(read_only_support());
  const uint64_t seed = test_seed(0xA11u);
  std::vector<LayerSpec> specs(2);
  specs[0].push_back(make_tensor("w", LWO_DTYPE_BF16, {300, 200}));
  specs[0].push_back(make_tensor("b", LWO_DTYPE_F32, {200}));
  specs[1].push_back(make_tensor("w", LWO_DTYPE_F16, {1000, 3}));
  Descs descs(specs);
  std::vector<uint64_t> off0(2), off1(1);
  uint64_t rb0 = 0, rb1 = 0;
  CHECK_LWO(lwo_record_layout(&descs.layers[0], off0.data(), &rb0));
  CHECK_LWO(lwo_record_layout(&descs.layers[1], off1.data(), &rb1));
  const size_t bytes = rb0 + rb1 + 4096;
  void* mem = std::malloc(bytes);
  ASSERT_NE(nullptr, mem);
  auto free_mem = defer([&] { std::free(mem); });
  fill_random(mem, bytes, seed);
  const uint64_t sum_before = host_checksum(mem, bytes);
  uint8_t* base = static_cast<uint8_t*>(mem);
  descs.tensors[0][0].host_data = base + off0[0];
  descs.tensors[0][1].host_data = base + off0[1];
  descs.tensors[1][0].host_data = base + rb0 + off1[0];
  lwo_host_region region{mem, bytes, nullptr};

  EXPECT_EQ(cudaMemoryTypeUnregistered, host_memory_type(mem));
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_registered(engine_, descs.layers.data(), 2, &region, 1, nullptr,
                                       &pool));
  EXPECT_EQ(cudaMemoryTypeHost, host_memory_type(mem)) << "registered for DMA";
  {
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(pool, 2, 0, &ring));
    Checks checks;
    ASSERT_NO_FATAL_FAILURE(checks.init(16));
    for (uint32_t l = 0; l < 2; ++l) {
      lwo_ticket t{0};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, stream(0), &t, &v));
      for (uint32_t i = 0; i < v.n_tensors; ++i) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        CHECK_LWO(lwo_pool_tensor_info(pool, l, i, &ti));
        const void* host = descs.tensors[l][i].host_data;
        CUDA_OK(checks.add(v.tensors[i], ti.bytes, host_checksum(host, ti.bytes), stream(0),
                           "layer " + std::to_string(l) + " " + ti.name));
      }
      CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
    }
    lwo_ring_stats st = ring_stats(ring.get());
    EXPECT_EQ(2u, st.n_copies);
    CHECK_LWO(ring.reset());
    checks.verify();
  }
  CHECK_LWO(lwo_pool_destroy(pool));
  EXPECT_EQ(cudaMemoryTypeUnregistered, host_memory_type(mem)) << "unregistered on destroy";
  EXPECT_EQ(sum_before, host_checksum(mem, bytes)) << "the pool must not write caller memory";
}

}  // namespace
}  // namespace lwo_test
