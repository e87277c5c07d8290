// Checkpoint pools on the device: every tensor the ring delivers equals the
// file's bytes, on the registered and the staged paths, under random orders
// and depths, checked by a consumer kernel on another stream.
#include <unistd.h>

#include <fstream>
#include <map>

#include "gpu_util.h"

namespace lwo_test {
namespace {

class CheckpointGpu : public GpuTest {
 protected:
  void TearDown() override {
    if (!path_.empty()) std::remove(path_.c_str());
    GpuTest::TearDown();
  }
  // Writes L layers of "layers.<i>.a" (bf16 [rows, 96]) and "layers.<i>.b"
  // (f32 [rows]) of random bytes, plus an unmapped "head"; remembers the host
  // checksum of every tensor.
  void write(uint32_t L, uint64_t seed) {
    char name[] = "/tmp/lwo_ckpt_gpu_XXXXXX";
    int fd = mkstemp(name);
    ASSERT_GE(fd, 0);
    close(fd);
    path_ = name;
    std::mt19937_64 rng(seed);
    std::string h = "{";
    uint64_t off = 0;
    std::vector<std::vector<uint8_t>> data;
    auto add = [&](const std::string& n, const char* dt, size_t es, std::vector<int64_t> shape) {
      size_t bytes = es;
      std::string sh;
      for (size_t d = 0; d < shape.size(); ++d) {
        bytes *= static_cast<size_t>(shape[d]);
        sh += (d ? "," : "") + std::to_string(shape[d]);
      }
      h += (off ? "," : "") + std::string("\"") + n + "\":{\"dtype\":\"" + dt + "\",\"shape\":[" + sh +
           "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + bytes) + "]}";
      off += bytes;
      data.emplace_back(bytes);
      fill_random(data.back().data(), bytes, rng());
      sums_[n] = lwo::kernels::checksum_host(data.back().data(), bytes);
    };
    add("head", "F32", 4, {7, 5});
    for (uint32_t i = 0; i < L; ++i) {
      int64_t rows = 64 + 32 * (rng() % 40);
      add("layers." + std::to_string(i) + ".a", "BF16", 2, {rows, 96});
      add("layers." + std::to_string(i) + ".b", "F32", 4, {rows});
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    uint64_t n = h.size();
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(h.data(), static_cast<std::streamsize>(n));
    for (auto& d : data) out.write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size()));
  }
  std::string path_;
  std::map<std::string, uint64_t> sums_;
};

TEST_F(CheckpointGpu, SlotsHoldTheFileBytesOnBothPaths) {
  const uint32_t L = 12;
  write(L, test_seed(91));
  if (HasFatalFailure()) return;
  lwo_checkpoint* ck = nullptr;
  CHECK_LWO(lwo_checkpoint_open(path_.c_str(), &ck));
  auto ck_guard = defer([&] { EXPECT_LWO_OK(lwo_checkpoint_destroy(ck)); });
  std::mt19937_64 rng(test_seed(92));
  for (uint32_t flags : {0u, LWO_CHECKPOINT_STAGED}) {
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "layers.{i}.";
    cfg.flags = flags;
    lwo_pool* pool = nullptr;
    CHECK_LWO(lwo_pool_create_from_checkpoint(engine_, ck, &cfg, &pool));
    auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
    lwo_pool_info pi{};
    pi.size = sizeof pi;
    CHECK_LWO(lwo_pool_get_info(pool, &pi));
    EXPECT_EQ(pi.kind, flags ? LWO_POOL_CHECKPOINT_STAGED : LWO_POOL_CHECKPOINT_MAPPED);
    for (uint32_t depth : {1u, 2u, 3u, 5u, 8u}) {
      SCOPED_TRACE(std::string(flags ? "staged" : "registered") + " depth " + std::to_string(depth));
      Ring ring;
      create_ring(pool, depth, 0, &ring);
      if (HasFatalFailure()) return;
      std::vector<uint32_t> order(120);
      for (auto& o : order) o = static_cast<uint32_t>(rng() % L);
      Schedule sched;
      CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()), sched.out()));
      Checks checks;
      checks.init(order.size() * 2);
      if (HasFatalFailure()) return;
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      int i = 0;
      lwo_status_t s;
      while ((s = lwo_schedule_next(sched.get(), stream(i % 2), &v)) == LWO_OK) {
        uint64_t ab = 0, bb = 0;
        lwo_tensor_info ta = LWO_TENSOR_INFO_INIT, tb = LWO_TENSOR_INFO_INIT;
        CHECK_LWO(lwo_pool_tensor_info(pool, v.layer, 0, &ta));
        CHECK_LWO(lwo_pool_tensor_info(pool, v.layer, 1, &tb));
        ab = ta.bytes;
        bb = tb.bytes;
        std::string base = "layers." + std::to_string(v.layer) + ".";
        EXPECT_STREQ(ta.name, "a");
        CUDA_OK(checks.add(v.tensors[0], ab, sums_[base + "a"], stream(i % 2), base + "a"));
        CUDA_OK(checks.add(v.tensors[1], bb, sums_[base + "b"], stream(i % 2), base + "b"));
        // The next call releases this layer on the next stream: join first.
        if (i % 2 == 0) {
          cudaEvent_t ev;
          CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
          CUDA_OK(cudaEventRecord(ev, stream(0)));
          CUDA_OK(cudaStreamWaitEvent(stream(1), ev, 0));
          CUDA_OK(cudaEventDestroy(ev));
        } else {
          cudaEvent_t ev;
          CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
          CUDA_OK(cudaEventRecord(ev, stream(1)));
          CUDA_OK(cudaStreamWaitEvent(stream(0), ev, 0));
          CUDA_OK(cudaEventDestroy(ev));
        }
        ++i;
      }
      EXPECT_EQ(s, LWO_END) << lwo_last_error_message();
      checks.verify();
    }
  }
}

}  // namespace
}  // namespace lwo_test
