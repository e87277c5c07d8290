// Devices, streams, timing and health: every call restores the caller's
// current device; two engines on two GPUs stream at once from one thread;
// the transfer stream lives on the engine's device; timing statistics are
// plausible; lwo_engine_check / lwo_engine_synchronize report healthy work.
#include "gpu/gpu_util.h"

namespace lwo_test {
namespace {

int current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) (void)cudaGetLastError();
  return d;
}

// Fails the test if the current device is not `want` after `what`.
#define EXPECT_CURRENT(want, what) \
  EXPECT_EQ((want), current_device()) << "current device changed by " << (what)

std::vector<LayerSpec> small_specs(uint32_t n_layers, uint32_t scale) {
  std::vector<LayerSpec> specs(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l) {
    specs[l].push_back(make_tensor("w", LWO_DTYPE_BF16, {int64_t(128 * scale + l), 64}));
    specs[l].push_back(make_tensor("b", LWO_DTYPE_F32, {64}));
    specs[l].push_back(make_tensor("q", LWO_DTYPE_I8, {int64_t(1000 + 17 * l)}));
  }
  return specs;
}

// With the caller on device `caller` and an engine on device `dev`, every call
// (successful or failed) leaves `caller` current.
void check_device_restored(int caller, int dev) {
  SCOPED_TRACE("caller on device " + std::to_string(caller) + ", engine on device " +
               std::to_string(dev));
  CUDA_OK(cudaSetDevice(caller));
  Engine engine;
  lwo_engine_config cfg;
  lwo_engine_config_init(&cfg);
  cfg.device = dev;
  CHECK_LWO(lwo_engine_create(&cfg, engine.out()));
  EXPECT_CURRENT(caller, "lwo_engine_create");
  int32_t reported = -1;
  CHECK_LWO(lwo_engine_device(engine.get(), &reported));
  EXPECT_EQ(dev, reported);

  // Consumer streams and result slots live on the engine's device.
  CUDA_OK(cudaSetDevice(dev));
  Stream stream;
  CUDA_OK(cudaStreamCreateWithFlags(stream.out(), cudaStreamNonBlocking));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(64));
  CUDA_OK(cudaSetDevice(caller));

  {
    TestPool tp;
    ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine.get(), small_specs(4, 2), 42, &tp));
    EXPECT_CURRENT(caller, "lwo_pool_create_pinned and pool queries");
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 2, LWO_RING_TIMING, &ring));
    EXPECT_CURRENT(caller, "lwo_ring_create");
    for (uint32_t l = 0; l < 4; ++l) {
      lwo_ticket t{0};
      CHECK_LWO(lwo_ring_stage(ring.get(), l, &t));
      EXPECT_CURRENT(caller, "lwo_ring_stage");
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_ring_acquire(ring.get(), t, stream.get(), &v));
      EXPECT_CURRENT(caller, "lwo_ring_acquire");
      void* p = nullptr;
      CHECK_LWO(lwo_ring_tensor(ring.get(), t, "q", &p));
      EXPECT_CURRENT(caller, "lwo_ring_tensor");
      CUDA_OK(cudaSetDevice(dev));
      CUDA_OK(checks.add(v.base, tp.layers[l].whole_bytes, tp.layers[l].whole_sum, stream.get(),
                         "layer " + std::to_string(l)));
      CUDA_OK(cudaSetDevice(caller));
      CHECK_LWO(lwo_ring_release(ring.get(), t, stream.get()));
      EXPECT_CURRENT(caller, "lwo_ring_release");
    }
    // Failed calls restore it too.
    lwo_ticket t{0};
    EXPECT_EQ(LWO_ERR_OUT_OF_RANGE, lwo_ring_stage(ring.get(), 99, &t));
    EXPECT_CURRENT(caller, "a failed lwo_ring_stage");
    lwo_ticket t0{0}, t1{0};
    CHECK_LWO(lwo_ring_stage(ring.get(), 0, &t0));
    CHECK_LWO(lwo_ring_stage(ring.get(), 1, &t1));
    EXPECT_EQ(LWO_ERR_RING_FULL, lwo_ring_stage(ring.get(), 2, &t));
    EXPECT_CURRENT(caller, "lwo_ring_stage returning RING_FULL");
    CHECK_LWO(lwo_ring_release(ring.get(), t0, stream.get()));
    CHECK_LWO(lwo_ring_release(ring.get(), t1, stream.get()));
    lwo_ring_stats st = ring_stats(ring.get());  // blocks on timing events
    EXPECT_CURRENT(caller, "lwo_ring_get_stats");
    EXPECT_GT(st.n_stages, 0u);
    CHECK_LWO(lwo_ring_reset_stats(ring.get()));
    EXPECT_CURRENT(caller, "lwo_ring_reset_stats");
    uint32_t order[] = {0, 1, 2, 3, 1};
    Schedule sched;
    CHECK_LWO(lwo_schedule_create(ring.get(), order, 5, sched.out()));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    lwo_status_t s;
    while ((s = lwo_schedule_next(sched.get(), stream.get(), &v)) == LWO_OK)
      EXPECT_CURRENT(caller, "lwo_schedule_next");
    EXPECT_EQ(LWO_END, s) << lwo_last_error_message();
    CHECK_LWO(lwo_schedule_reset(sched.get(), stream.get()));
    EXPECT_CURRENT(caller, "lwo_schedule_reset");
    CHECK_LWO(sched.reset());
    EXPECT_CURRENT(caller, "lwo_schedule_destroy");
    CHECK_LWO(lwo_engine_check(engine.get()));
    EXPECT_CURRENT(caller, "lwo_engine_check");
    CHECK_LWO(lwo_engine_synchronize(engine.get()));
    EXPECT_CURRENT(caller, "lwo_engine_synchronize");
    CHECK_LWO(ring.reset());
    EXPECT_CURRENT(caller, "lwo_ring_destroy");
    CHECK_LWO(tp.destroy());
    EXPECT_CURRENT(caller, "lwo_pool_destroy");
  }
  CHECK_LWO(engine.reset());
  EXPECT_CURRENT(caller, "lwo_engine_destroy");
  checks.verify();
  EXPECT_CURRENT(caller, "(test) Checks::verify");
}

TEST_F(GpuOnlyTest, CurrentDeviceIsRestored) {
  const int n = device_count();
  const int last = n - 1;
  if (n < 2)
    std::printf("[   note   ] one device: restoration checked with caller and engine on 0 only\n");
  std::vector<int> devices = {0};
  if (last > 0) devices.push_back(last);
  for (int caller : devices)
    for (int dev : devices) ASSERT_NO_FATAL_FAILURE(check_device_restored(caller, dev));
  // A device that does not exist: LWO_ERR_NO_DEVICE, nothing created, device kept.
  CUDA_OK(cudaSetDevice(last));
  lwo_engine_config cfg;
  lwo_engine_config_init(&cfg);
  cfg.device = n;
  lwo_engine* e = reinterpret_cast<lwo_engine*>(uintptr_t(1));
  EXPECT_LWO_ERR(LWO_ERR_NO_DEVICE, "lwo_engine_create", lwo_engine_create(&cfg, &e));
  EXPECT_EQ(nullptr, e);
  EXPECT_CURRENT(last, "a failed lwo_engine_create");
}

TEST_F(GpuOnlyTest, TransferStreamIsOnTheEngineDevice) {
  const int n = std::min(device_count(), 2);
  for (int dev = 0; dev < n; ++dev) {
    SCOPED_TRACE("device " + std::to_string(dev));
    Engine engine;
    lwo_engine_config cfg;
    lwo_engine_config_init(&cfg);
    cfg.device = dev;
    CHECK_LWO(lwo_engine_create(&cfg, engine.out()));
    lwo_stream_t s = nullptr, s2 = nullptr;
    CHECK_LWO(lwo_engine_transfer_stream(engine.get(), &s));
    ASSERT_NE(nullptr, s) << "the transfer stream is the engine's own, not the legacy stream";
    CHECK_LWO(lwo_engine_transfer_stream(engine.get(), &s2));
    EXPECT_EQ(s, s2) << "one transfer stream per engine";
    int sd = -1;
    CUDA_OK(cudaStreamGetDevice(s, &sd));
    EXPECT_EQ(dev, sd);
    unsigned flags = 0;
    CUDA_OK(cudaStreamGetFlags(s, &flags));
    EXPECT_EQ(unsigned(cudaStreamNonBlocking), flags & cudaStreamNonBlocking)
        << "the transfer stream must not synchronise with the legacy stream";
    CHECK_LWO(engine.reset());
  }
}

// Two engines on two GPUs, driven from one thread: each streams its own pool
// through its own ring, interleaved call by call, and each slot is checked.
TEST_F(GpuOnlyTest, TwoEnginesOnTwoDevicesStreamConcurrently) {
  const int n = device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << n;
  struct PerDevice {
    Engine engine;
    TestPool tp;
    Ring ring;
    Stream stream;
    Checks checks;
  };
  PerDevice d[2];
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("device " + std::to_string(i));
    lwo_engine_config cfg;
    lwo_engine_config_init(&cfg);
    cfg.device = i;
    CUDA_OK(cudaSetDevice(0));
    CHECK_LWO(lwo_engine_create(&cfg, d[i].engine.out()));
    lwo_stream_t ts = nullptr;
    CHECK_LWO(lwo_engine_transfer_stream(d[i].engine.get(), &ts));
    int sd = -1;
    CUDA_OK(cudaStreamGetDevice(ts, &sd));
    EXPECT_EQ(i, sd) << "transfer stream of the engine on device " << i;
    std::mt19937_64 rng(test_seed(100 + i));
    ASSERT_NO_FATAL_FAILURE(create_pinned_pool(
        d[i].engine.get(), random_layer_specs(rng, 8, 64, uint64_t(4) << 20, 3), 100 + i, &d[i].tp));
    ASSERT_NO_FATAL_FAILURE(create_ring(d[i].tp.pool, 3, LWO_RING_TIMING, &d[i].ring));
    CUDA_OK(cudaSetDevice(i));
    CUDA_OK(cudaStreamCreateWithFlags(d[i].stream.out(), cudaStreamNonBlocking));
    ASSERT_NO_FATAL_FAILURE(d[i].checks.init(512));
    EXPECT_CURRENT(i, "setup");
  }
  // Both rings stream 4 passes over their layers, one step of each in turn,
  // two layers staged ahead; the caller stays on device 0 except to launch
  // the checksum kernels.
  CUDA_OK(cudaSetDevice(0));
  for (int pass = 0; pass < 4; ++pass) {
    std::vector<lwo_ticket> ahead[2];
    const uint32_t nl = d[0].tp.n_layers();
    for (uint32_t k = 0; k < nl + 2; ++k) {
      for (int i = 0; i < 2; ++i) {
        PerDevice& p = d[i];
        const uint32_t layers = p.tp.n_layers();
        if (k < layers) {
          lwo_ticket t{0};
          CHECK_LWO(lwo_ring_stage(p.ring.get(), (k + pass) % layers, &t));
          ahead[i].push_back(t);
        }
        if (k >= 2 && k - 2 < layers) {
          const uint32_t layer = (k - 2 + pass) % layers;
          lwo_ticket t = ahead[i].front();
          ahead[i].erase(ahead[i].begin());
          lwo_layer_view v = LWO_LAYER_VIEW_INIT;
          CHECK_LWO(lwo_ring_acquire(p.ring.get(), t, p.stream.get(), &v));
          ASSERT_EQ(layer, v.layer);
          CUDA_OK(cudaSetDevice(i));
          const LayerRef& lr = p.tp.layers[layer];
          if (lr.whole_bytes)
            CUDA_OK(p.checks.add(v.base, lr.whole_bytes, lr.whole_sum, p.stream.get(),
                                 "device " + std::to_string(i) + " pass " +
                                     std::to_string(pass) + " layer " + std::to_string(layer)));
          CUDA_OK(cudaSetDevice(0));
          CHECK_LWO(lwo_ring_release(p.ring.get(), t, p.stream.get()));
          EXPECT_CURRENT(0, "ring calls of device " + std::to_string(i));
        }
      }
    }
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("device " + std::to_string(i));
    lwo_ring_stats st = ring_stats(d[i].ring.get());
    std::printf("[  2 gpus  ] device %d: %llu copies, %.1f MB, %.2f GB/s\n", i,
                (unsigned long long)st.n_copies, st.bytes_copied / 1e6, st.bandwidth_gbps);
    EXPECT_GT(st.copy_ms, 0.0);
    CHECK_LWO(lwo_engine_check(d[i].engine.get()));
    CHECK_LWO(lwo_engine_synchronize(d[i].engine.get()));
    CUDA_OK(cudaSetDevice(i));
    CUDA_OK(cudaStreamSynchronize(d[i].stream.get()));
    CUDA_OK(cudaSetDevice(0));
    d[i].checks.verify();
    CHECK_LWO(d[i].ring.reset());
    CHECK_LWO(d[i].tp.destroy());
    CHECK_LWO(d[i].engine.reset());
  }
}

// Timing: copy_ms and bandwidth after real copies; nothing without the flag.
TEST_F(GpuTest, TimingStatsArePlausible) {
  // 6 layers of 4 MiB through depth 2, three rounds: every stage is a copy.
  std::vector<LayerSpec> specs(6);
  for (auto& s : specs) {
    s.push_back(make_tensor("w", LWO_DTYPE_BF16, {1024, 2048 - 64}));
    s.push_back(make_tensor("b", LWO_DTYPE_F32, {64 * 128}));
  }
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, specs, 5, &tp));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(256));
  Ring timed, plain;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 2, LWO_RING_TIMING, &timed));
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 2, 0, &plain));
  for (int round = 0; round < 3; ++round)
    for (uint32_t l = 0; l < tp.n_layers(); ++l) {
      ASSERT_NO_FATAL_FAILURE(round_trip(timed.get(), tp, l, stream(0), &checks, "timed"));
      if (round == 0) {
        ASSERT_NO_FATAL_FAILURE(round_trip(plain.get(), tp, l, stream(1), &checks, "plain"));
      }
    }
  lwo_ring_stats st = ring_stats(timed.get());
  std::printf("[  timing  ] %llu copies, %.1f MB in %.3f ms: %.2f GB/s, waited %.3f ms\n",
              (unsigned long long)st.n_copies, st.bytes_copied / 1e6, st.copy_ms,
              st.bandwidth_gbps, st.wait_ms);
  EXPECT_EQ(18u, st.n_copies);
  EXPECT_EQ(18 * tp.layers[0].record_bytes, st.bytes_copied);
  EXPECT_GT(st.copy_ms, 0.0);
  EXPECT_GT(st.bandwidth_gbps, 1.0) << "pinned H2D below 1 GB/s is not plausible";
  EXPECT_LT(st.bandwidth_gbps, 1000.0) << "faster than any host link: timing is wrong";
  EXPECT_NEAR(st.bandwidth_gbps, st.bytes_copied / (st.copy_ms * 1e6), 1e-6 * st.bandwidth_gbps);
  EXPECT_GE(st.wait_ms, 0.0);
  // Without the flag: counts, but no timing.
  lwo_ring_stats ps = ring_stats(plain.get());
  EXPECT_EQ(6u, ps.n_copies);
  EXPECT_EQ(0.0, ps.copy_ms);
  EXPECT_EQ(0.0, ps.wait_ms);
  EXPECT_EQ(0.0, ps.bandwidth_gbps);
  // Reset zeroes everything; new copies count again.
  CHECK_LWO(lwo_ring_reset_stats(timed.get()));
  lwo_ring_stats z = ring_stats(timed.get());
  EXPECT_EQ(0u, z.n_stages);
  EXPECT_EQ(0u, z.n_copies);
  EXPECT_EQ(0u, z.bytes_copied);
  EXPECT_EQ(0.0, z.copy_ms);
  EXPECT_EQ(0.0, z.bandwidth_gbps);
  for (uint32_t l = 0; l < 3; ++l)
    ASSERT_NO_FATAL_FAILURE(round_trip(timed.get(), tp, l, stream(0), &checks, "after reset"));
  z = ring_stats(timed.get());
  EXPECT_EQ(3u, z.n_stages);
  EXPECT_GT(z.copy_ms, 0.0);
  // A caller with an older, shorter stats struct gets only what it asked for.
  {
    struct Sentinel {
      lwo_ring_stats st;
      uint8_t guard[16];
    } s;
    std::memset(&s, 0xEE, sizeof s);
    s.st.size = offsetof(lwo_ring_stats, copy_ms);
    CHECK_LWO(lwo_ring_get_stats(timed.get(), &s.st));
    EXPECT_EQ(3u, s.st.n_stages);
    const uint8_t* tail = reinterpret_cast<const uint8_t*>(&s.st) + offsetof(lwo_ring_stats, copy_ms);
    for (size_t i = 0; i < sizeof(lwo_ring_stats) - offsetof(lwo_ring_stats, copy_ms); ++i)
      ASSERT_EQ(0xEE, tail[i]) << "byte " << i << " past the caller's size was written";
  }
  CHECK_LWO(timed.reset());
  CHECK_LWO(plain.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

// Health: after healthy work (including work still in flight) the engine
// reports LWO_OK, and synchronize waits and reports LWO_OK.
TEST_F(GpuTest, EngineCheckAndSynchronizeAfterHealthyWork) {
  CHECK_LWO(lwo_engine_check(engine_));
  CHECK_LWO(lwo_engine_synchronize(engine_));
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, small_specs(5, 16), 9, &tp));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(128));
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 2, 0, &ring));
  lwo_stream_t transfer = nullptr;
  CHECK_LWO(lwo_engine_transfer_stream(engine_, &transfer));
  for (int round = 0; round < 4; ++round) {
    // Keep the transfer stream busy so that the checks run with work in flight.
    CUDA_OK(stream_delay(transfer, 2000));
    for (uint32_t l = 0; l < tp.n_layers(); ++l)
      ASSERT_NO_FATAL_FAILURE(round_trip(ring.get(), tp, l, stream(round % 2), &checks, "health"));
    CHECK_LWO(lwo_engine_check(engine_));
  }
  CHECK_LWO(lwo_engine_synchronize(engine_));
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(transfer)) << "synchronize waited for the transfer stream";
  CHECK_LWO(lwo_engine_check(engine_));
  int32_t dev = -1;
  CHECK_LWO(lwo_engine_device(engine_, &dev));
  EXPECT_EQ(0, dev);
  EXPECT_EQ(unsigned(LWO_VERSION), lwo_version());
  CHECK_LWO(ring.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

}  // namespace
}  // namespace lwo_test
