// Argument and handle validation of the C API, on the recording backend.
#include <atomic>

#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using ApiTest = EngineTest;

std::string msg() { return lwo_last_error_message(); }

TEST(Api, VersionAndStatusNames) {
  EXPECT_EQ(lwo_version(), static_cast<unsigned>(LWO_VERSION));
  EXPECT_EQ(LWO_VERSION, LWO_VERSION_MAJOR * 10000 + LWO_VERSION_MINOR * 100 + LWO_VERSION_PATCH);
  std::set<std::string> names;
  const lwo_status_t all[] = {
      LWO_OK, LWO_END, LWO_ERR_INVALID_ARGUMENT, LWO_ERR_INVALID_HANDLE, LWO_ERR_OUT_OF_RANGE,
      LWO_ERR_NOT_FOUND, LWO_ERR_SIZE_MISMATCH, LWO_ERR_FOREIGN_TICKET, LWO_ERR_FOREIGN_OBJECT,
      LWO_ERR_UNSUPPORTED, LWO_ERR_RING_FULL, LWO_ERR_LAYER_BUSY, LWO_ERR_STALE_TICKET,
      LWO_ERR_TICKET_STATE, LWO_ERR_BUSY, LWO_ERR_FILE_CHANGED, LWO_ERR_OUT_OF_MEMORY,
      LWO_ERR_IO, LWO_ERR_OVER_BUDGET, LWO_ERR_NO_DEVICE, LWO_ERR_CUDA, LWO_ERR_CUBLAS, LWO_ERR_CUDNN, LWO_ERR_NCCL,
      LWO_ERR_TRUNCATED, LWO_ERR_BAD_HEADER_SIZE, LWO_ERR_BAD_JSON, LWO_ERR_BAD_DTYPE,
      LWO_ERR_SHAPE_MISMATCH, LWO_ERR_SHAPE_OVERFLOW, LWO_ERR_BAD_RANGE, LWO_ERR_OVERLAP,
      LWO_ERR_COLLECTIVE_MISMATCH, LWO_ERR_INTERNAL};
  for (lwo_status_t s : all) {
    std::string n = lwo_status_string(s);
    EXPECT_EQ(n.rfind("LWO_", 0), 0u) << s;
    names.insert(n);
  }
  EXPECT_EQ(names.size(), sizeof all / sizeof all[0]);  // all distinct
  // Each status sits in its class's range.
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_END), LWO_STATUS_CLASS_SUCCESS);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_UNSUPPORTED), LWO_STATUS_CLASS_ARGUMENT);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_FILE_CHANGED), LWO_STATUS_CLASS_STATE);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_IO), LWO_STATUS_CLASS_RESOURCE);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_NCCL), LWO_STATUS_CLASS_DEVICE);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_OVERLAP), LWO_STATUS_CLASS_FORMAT);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_COLLECTIVE_MISMATCH), LWO_STATUS_CLASS_COLLECTIVE);
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_INTERNAL), LWO_STATUS_CLASS_INTERNAL);
  EXPECT_STREQ(lwo_status_string(static_cast<lwo_status_t>(-3)), "unknown status");
  EXPECT_EQ(sizeof(lwo_status_t), 4u);
}

TEST(Api, EngineCreateValidatesArguments) {
  EXPECT_EQ(lwo_engine_create(nullptr, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("lwo_engine_create"), std::string::npos);
  lwo_engine* e = reinterpret_cast<lwo_engine*>(0x1);
  lwo_engine_config c = LWO_ENGINE_CONFIG_INIT;
  c.flags = 0x80;
  EXPECT_EQ(lwo_engine_create(&c, &e), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(e, nullptr);
  EXPECT_NE(msg().find("unknown flags 0x80"), std::string::npos);
  c = lwo_engine_config LWO_ENGINE_CONFIG_INIT;
  c.device = -2;
  EXPECT_EQ(lwo_engine_create(&c, &e), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("device -2"), std::string::npos);
  c = lwo_engine_config LWO_ENGINE_CONFIG_INIT;
  c.size = 3;
  EXPECT_EQ(lwo_engine_create(&c, &e), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("config size 3"), std::string::npos);
}

// Without a GPU (CI), a real engine cannot be made, and says so.
TEST(Api, EngineCreateWithoutDeviceSaysSo) {
  lwo_engine_config c = LWO_ENGINE_CONFIG_INIT;
  c.device = 4000;  // no machine has this many
  lwo_engine* e = nullptr;
  EXPECT_EQ(lwo_engine_create(&c, &e), LWO_ERR_NO_DEVICE);
  EXPECT_EQ(e, nullptr);
  std::string m = msg();
  EXPECT_TRUE(m.find("no CUDA device") != std::string::npos ||
              m.find("device 4000 does not exist") != std::string::npos)
      << m;
}

// Without a usable GPU the refusal says which of the four reasons it is and
// what to do: no driver, a driver older than the runtime, no GPU, or a GPU
// older than every architecture built. (With one, there is nothing to check.)
TEST(Api, NoDeviceSaysWhyAndWhatToDo) {
  lwo_engine* e = nullptr;
  lwo_status_t s = lwo_engine_create(nullptr, &e);
  if (s == LWO_OK) {
    EXPECT_EQ(lwo_engine_destroy(e), LWO_OK);
    return;
  }
  ASSERT_EQ(s, LWO_ERR_NO_DEVICE) << msg();
  std::string m = msg();
  const char* reasons[] = {"no NVIDIA driver is installed", "older than the CUDA",
                           "found no GPU", "older than every architecture"};
  int found = 0;
  for (const char* r : reasons) found += m.find(r) != std::string::npos;
  EXPECT_EQ(found, 1) << m;
  EXPECT_EQ(m.find("driver version is insufficient"), std::string::npos) << m;
}

TEST_F(ApiTest, NullAndDestroyedAndForeignHandles) {
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(nullptr, 0, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_NE(msg().find("lwo_ring_stage: ring handle is NULL"), std::string::npos);
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 2);
  // A pool passed where a ring is expected (through a cast, as an FFI might).
  EXPECT_EQ(lwo_ring_stage(reinterpret_cast<lwo_ring*>(pool), 0, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_NE(msg().find("is a pool, not a ring"), std::string::npos);
  ASSERT_LWO(lwo_ring_destroy(ring));
  // The destroyed handle is recognised, not dereferenced.
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_NE(msg().find("not a live lwo object"), std::string::npos);
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_INVALID_HANDLE);
  int local = 0;
  EXPECT_EQ(lwo_pool_destroy(reinterpret_cast<lwo_pool*>(&local)), LWO_ERR_INVALID_HANDLE);
  // Destroying NULL is fine and clears the message.
  EXPECT_EQ(lwo_ring_destroy(nullptr), LWO_OK);
  EXPECT_EQ(msg(), "");
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// A destroyed handle stays invalid when a new object takes its place: 10^5
// engines (over the recording backend: no GPU) created and destroyed, each
// after the first one's destruction. The allocator reuses the same address
// for most of them; the first handle, and the one of the cycle before, must
// answer LWO_ERR_INVALID_HANDLE, and destroying them must leave the live
// engine alone.
TEST(ApiHandles, StaleHandleStaysInvalidWhenItsAddressIsReused) {
  lwo_engine* first = nullptr;
  ASSERT_LWO(engine_create(std::make_unique<RecordingBackend>(), 0, &first));
  ASSERT_LWO(lwo_engine_destroy(first));
  lwo_engine* prev = first;
  for (int i = 0; i < 100000; ++i) {
    lwo_engine* e = nullptr;
    ASSERT_LWO(engine_create(std::make_unique<RecordingBackend>(), 0, &e));
    int32_t dev = -1;
    ASSERT_EQ(lwo_engine_device(first, &dev), LWO_ERR_INVALID_HANDLE) << "cycle " << i;
    ASSERT_EQ(lwo_engine_device(prev, &dev), LWO_ERR_INVALID_HANDLE) << "cycle " << i;
    ASSERT_EQ(lwo_engine_destroy(first), LWO_ERR_INVALID_HANDLE) << "cycle " << i;
    ASSERT_NE(msg().find("not a live lwo object"), std::string::npos) << msg();
    ASSERT_LWO(lwo_engine_device(e, &dev));
    ASSERT_LWO(lwo_engine_destroy(e));
    prev = e;
  }
}

// Handles made, looked up and destroyed from several threads at once.
TEST(ApiHandles, RegistryIsThreadSafe) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      std::vector<lwo_engine*> dead;
      for (int i = 0; i < 5000; ++i) {
        lwo_engine* e = nullptr;
        if (engine_create(std::make_unique<RecordingBackend>(), 0, &e) != LWO_OK) ++failures;
        int32_t dev = -1;
        if (lwo_engine_device(e, &dev) != LWO_OK) ++failures;
        for (size_t k = dead.size() > 4 ? dead.size() - 4 : 0; k < dead.size(); ++k)
          if (lwo_engine_device(dead[k], &dev) != LWO_ERR_INVALID_HANDLE) ++failures;
        if (lwo_engine_destroy(e) != LWO_OK) ++failures;
        dead.push_back(e);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(ApiTest, DestroyOrderIsEnforced) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  uint32_t order[2] = {0, 1};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  EXPECT_EQ(lwo_engine_destroy(engine), LWO_ERR_BUSY);
  EXPECT_NE(msg().find("1 pool"), std::string::npos);
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_ERR_BUSY);
  EXPECT_NE(msg().find("1 ring"), std::string::npos);
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  EXPECT_NE(msg().find("schedule"), std::string::npos);
  destroy(s, ring, pool);
}

TEST_F(ApiTest, ConfigsAreCheckedAndDefaulted) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = nullptr;
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 0;
  EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("depth 0"), std::string::npos);
  c.depth = 5000;
  EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_ERR_INVALID_ARGUMENT);
  c = lwo_ring_config LWO_RING_CONFIG_INIT;
  c.flags = 0x10;
  EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("unknown flags 0x10"), std::string::npos);
  // An older, shorter config: fields past its size take their defaults.
  c = lwo_ring_config LWO_RING_CONFIG_INIT;
  c.size = offsetof(lwo_ring_config, depth);
  c.depth = 0;  // not read
  ASSERT_LWO(lwo_ring_create(pool, &c, &ring));
  lwo_ring_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_ring_get_info(ring, &info));
  EXPECT_EQ(info.depth, 2u);
  EXPECT_EQ(info.n_free, 2u);
  lwo_pool_info pi{};
  pi.size = sizeof pi;
  ASSERT_LWO(lwo_pool_get_info(pool, &pi));
  EXPECT_EQ(info.slot_bytes, pi.max_record_bytes);
  EXPECT_EQ(pi.n_layers, 2u);
  // An output struct with no size set is refused.
  lwo_ring_stats st{};
  EXPECT_EQ(lwo_ring_get_stats(ring, &st), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_ring_destroy(ring));
  lwo_pool_config pc = LWO_POOL_CONFIG_INIT;
  pc.flags = 1;
  ModelDesc m(1);
  lwo_pool* p2 = nullptr;
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 1, &pc, &p2), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p2, nullptr);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Every call makes the engine's device current and gives the caller's back.
TEST(ApiDevice, CallerDeviceIsRestored) {
  auto be = std::make_unique<RecordingBackend>();
  RecordingBackend* gpu = be.get();
  lwo_engine* engine = nullptr;
  ASSERT_LWO(engine_create(std::move(be), 1, &engine));
  gpu->current_device = 0;
  ModelDesc m(3);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), 3, nullptr, &pool));
  EXPECT_EQ(gpu->current_device, 0);
  lwo_ring* ring = nullptr;
  ASSERT_LWO(lwo_ring_create(pool, nullptr, &ring));
  StreamH c = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  int calls = gpu->set_device_calls;
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
  ASSERT_LWO(lwo_ring_acquire(ring, t, static_cast<lwo_stream_t>(c), &v));
  ASSERT_LWO(lwo_ring_release(ring, t, static_cast<lwo_stream_t>(c)));
  EXPECT_EQ(gpu->current_device, 0);
  EXPECT_GE(gpu->set_device_calls, calls + 6);  // switched to 1 and back, each call
  // On the engine's own device, no switching at all.
  gpu->current_device = 1;
  calls = gpu->set_device_calls;
  ASSERT_LWO(lwo_ring_stage(ring, 2, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, static_cast<lwo_stream_t>(c)));
  EXPECT_EQ(gpu->set_device_calls, calls);
  EXPECT_EQ(gpu->current_device, 1);
  int32_t dev = -1;
  ASSERT_LWO(lwo_engine_device(engine, &dev));
  EXPECT_EQ(dev, 1);
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_check(engine));
  ASSERT_LWO(lwo_engine_synchronize(engine));
  ASSERT_LWO(lwo_engine_destroy(engine));
}

TEST_F(ApiTest, MessagesArePerThreadAndClearedOnSuccess) {
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(nullptr, 0, &t), LWO_ERR_INVALID_HANDLE);
  std::string other;
  std::thread th([&] { other = lwo_last_error_message(); });
  th.join();
  EXPECT_EQ(other, "");
  EXPECT_NE(msg(), "");
  int32_t d = 0;
  ASSERT_LWO(lwo_engine_device(engine, &d));
  EXPECT_EQ(msg(), "");
}

}  // namespace
}  // namespace testing
}  // namespace lwo
