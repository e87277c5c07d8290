// lwo_nccl_comm_destroy destroys only the communicators lwo_nccl_comm_create
// made: any other pointer (never made by lwo, or already destroyed) is
// LWO_ERR_INVALID_HANDLE and is never touched, while a caller's own
// communicator is still accepted by lwo_pool_create_sharded. No device
// needed: every pointer here is refused before NCCL sees it.
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "engine/comm.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

using CommTest = EngineTest;

TEST_F(CommTest, DestroyOfForeignPointerIsInvalidHandle) {
  // A stack address: not a communicator at all. Its bytes must stay as they are.
  unsigned char not_a_comm[64];
  std::memset(not_a_comm, 0xAB, sizeof not_a_comm);
  auto comm = reinterpret_cast<lwo_nccl_comm_t>(not_a_comm);
  EXPECT_EQ(lwo_nccl_comm_destroy(comm), LWO_ERR_INVALID_HANDLE);
  std::string m = lwo_last_error_message();
  EXPECT_EQ(m.rfind("lwo_nccl_comm_destroy: ", 0), 0u) << m;
  EXPECT_NE(m.find(pointer_text(not_a_comm)), std::string::npos) << m;
  for (unsigned char b : not_a_comm) ASSERT_EQ(b, 0xAB);
  // Refused again, the same way: nothing was recorded by the first refusal.
  EXPECT_EQ(lwo_nccl_comm_destroy(comm), LWO_ERR_INVALID_HANDLE);

  // A heap pointer and a small integer cast to a pointer are refused too.
  std::vector<unsigned char> heap(256, 0x5A);
  EXPECT_EQ(lwo_nccl_comm_destroy(reinterpret_cast<lwo_nccl_comm_t>(heap.data())),
            LWO_ERR_INVALID_HANDLE);
  for (unsigned char b : heap) ASSERT_EQ(b, 0x5A);
  EXPECT_EQ(lwo_nccl_comm_destroy(reinterpret_cast<lwo_nccl_comm_t>(uintptr_t{8})),
            LWO_ERR_INVALID_HANDLE);
}

TEST_F(CommTest, DestroyOfNullDoesNothing) {
  EXPECT_EQ(lwo_nccl_comm_destroy(nullptr), LWO_OK) << lwo_last_error_message();
}

TEST_F(CommTest, CallersOwnCommunicatorIsStillAcceptedByPools) {
  // Only destroy is restricted: a communicator lwo did not make (here the
  // recording backend's stand-in, a stack address) still makes a sharded pool.
  int callers_comm = 0;
  auto comm = reinterpret_cast<lwo_nccl_comm_t>(&callers_comm);
  EXPECT_EQ(lwo_nccl_comm_destroy(comm), LWO_ERR_INVALID_HANDLE);
  ModelDesc m(2);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 2, comm, nullptr, &pool));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// The registry behind lwo_nccl_comm_destroy (engine/comm.h), without NCCL: a
// communicator that was destroyed (taken out of the registry) is refused like
// any foreign pointer.
TEST(CommRegistry, ADestroyedCommunicatorIsInvalidHandle) {
  unsigned char stand_in[16] = {};
  void* comm = stand_in;
  register_comm(comm);
  EXPECT_TRUE(unregister_comm(comm));   // what lwo_nccl_comm_destroy does first
  EXPECT_FALSE(unregister_comm(comm));  // a second destroy finds nothing
  EXPECT_EQ(lwo_nccl_comm_destroy(static_cast<lwo_nccl_comm_t>(comm)), LWO_ERR_INVALID_HANDLE);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("already destroyed"), std::string::npos) << m;
}

// Threads registering and taking communicators at once: each one is taken
// exactly once, however many threads race for it, and none is lost.
TEST(CommRegistry, ConcurrentDestroysTakeEachCommunicatorOnce) {
  constexpr int kComms = 4096, kThreads = 8;
  std::vector<unsigned char> stand_ins(kComms);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < kComms; i += kThreads) register_comm(&stand_ins[i]);
    });
  for (auto& th : threads) th.join();
  threads.clear();
  std::vector<std::atomic<int>> taken(kComms);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kComms; ++i)
        if (unregister_comm(&stand_ins[i])) taken[i].fetch_add(1);
    });
  for (auto& th : threads) th.join();
  for (int i = 0; i < kComms; ++i) ASSERT_EQ(taken[i].load(), 1) << "communicator " << i;
}

}  // namespace
}  // namespace testing
}  // namespace lwo
