// Stream ordering of the ring, each case forced with a stalled stream (a host
// function that sleeps) so that a missing wait shows up as a wrong checksum:
// copies wait for every earlier reader of the slot, readers wait for copies.
#include "gpu/gpu_util.h"

namespace lwo_test {
namespace {

constexpr unsigned kStallUs = 20000;  // 20 ms: far longer than enqueueing the rest

class RingOrder : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (!engine_ || HasFatalFailure()) return;
    std::vector<LayerSpec> specs(3);
    for (uint32_t l = 0; l < 3; ++l) {
      specs[l].push_back(make_tensor("w", LWO_DTYPE_BF16, {512, 1000 + int64_t(l)}));
      specs[l].push_back(make_tensor("b", LWO_DTYPE_F32, {1000}));
    }
    ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, std::move(specs), 31337, &tp_));
    ASSERT_NO_FATAL_FAILURE(checks_.init(64));
    ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 1, 0, &ring_));
  }
  void TearDown() override {
    if (ring_.get()) EXPECT_LWO_OK(ring_.reset());
    if (tp_.pool) {
      checks_.verify();
      EXPECT_LWO_OK(tp_.destroy());
    }
    GpuTest::TearDown();
  }
  void read(const lwo_layer_view& v, cudaStream_t s, const char* what) {
    const LayerRef& lr = tp_.layers[v.layer];
    CUDA_OK(checks_.add(v.base, lr.whole_bytes, lr.whole_sum, s, what));
  }
  // Stages `layer`, acquires it on `s` and reads it there (after a stall if
  // `stall`), releases it on `s`.
  void slow_read(uint32_t layer, cudaStream_t s, bool stall, const char* what) {
    lwo_ticket t{0};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring_.get(), layer, s, &t, &v));
    if (stall) CUDA_OK(stream_delay(s, kStallUs));
    ASSERT_NO_FATAL_FAILURE(read(v, s, what));
    CHECK_LWO(lwo_ring_release(ring_.get(), t, s));
  }

  TestPool tp_;
  Checks checks_;
  Ring ring_;
};

// A copy into a slot waits for the reader that released it.
TEST_F(RingOrder, CopyWaitsForTheLastReader) {
  ASSERT_NO_FATAL_FAILURE(slow_read(0, stream(0), true, "stalled reader of layer 0"));
  ASSERT_NO_FATAL_FAILURE(slow_read(1, stream(1), false, "layer 1 evicting layer 0"));
}

// A reader waits for the copy: the transfer stream is stalled before it.
TEST_F(RingOrder, ReaderWaitsForTheCopy) {
  lwo_stream_t transfer = nullptr;
  CHECK_LWO(lwo_engine_transfer_stream(engine_, &transfer));
  CUDA_OK(stream_delay(transfer, kStallUs));
  ASSERT_NO_FATAL_FAILURE(slow_read(0, stream(0), false, "layer 0 behind a stalled copy"));
  CUDA_OK(stream_delay(transfer, kStallUs));
  ASSERT_NO_FATAL_FAILURE(slow_read(1, stream(1), false, "layer 1 behind a stalled copy"));
}

// After a hit acquired on another stream, the eviction still waits for the
// first (stalled) reader: the hit's acquire joined the earlier release.
TEST_F(RingOrder, EvictionWaitsForReadersOfEveryOccupancy) {
  ASSERT_NO_FATAL_FAILURE(slow_read(0, stream(0), true, "stalled first reader of layer 0"));
  uint64_t hits = ring_stats(ring_.get()).n_hits;
  ASSERT_NO_FATAL_FAILURE(slow_read(0, stream(1), false, "hit of layer 0 on another stream"));
  EXPECT_EQ(hits + 1, ring_stats(ring_.get()).n_hits);
  ASSERT_NO_FATAL_FAILURE(slow_read(1, stream(1), false, "layer 1 evicting layer 0"));
}

// Same, when the hit is released on another stream without being acquired.
TEST_F(RingOrder, EvictionWaitsAfterAnUnacquiredHit) {
  ASSERT_NO_FATAL_FAILURE(slow_read(0, stream(0), true, "stalled reader of layer 0"));
  lwo_ticket t{0};
  CHECK_LWO(lwo_ring_stage(ring_.get(), 0, &t));
  CHECK_LWO(lwo_ring_release(ring_.get(), t, stream(1)));
  ASSERT_NO_FATAL_FAILURE(slow_read(2, stream(1), false, "layer 2 evicting layer 0"));
}

// Reads on two streams, joined into one before the release (the documented
// pattern), all finish before the slot is overwritten.
TEST_F(RingOrder, ReadersJoinedIntoTheReleasingStream) {
  lwo_ticket t{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring_.get(), 1, stream(0), &t, &v));
  Event acquired, read_done;
  CUDA_OK(cudaEventCreateWithFlags(acquired.out(), cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(read_done.out(), cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(acquired.get(), stream(0)));
  CUDA_OK(cudaStreamWaitEvent(stream(1), acquired.get(), 0));
  CUDA_OK(stream_delay(stream(1), kStallUs));
  ASSERT_NO_FATAL_FAILURE(read(v, stream(1), "stalled second reader of layer 1"));
  CUDA_OK(cudaEventRecord(read_done.get(), stream(1)));
  ASSERT_NO_FATAL_FAILURE(read(v, stream(0), "first reader of layer 1"));
  CUDA_OK(cudaStreamWaitEvent(stream(0), read_done.get(), 0));
  CHECK_LWO(lwo_ring_release(ring_.get(), t, stream(0)));
  ASSERT_NO_FATAL_FAILURE(slow_read(2, stream(0), false, "layer 2 evicting layer 1"));
}

}  // namespace
}  // namespace lwo_test
