// lwo_nccl_comm_destroy destroys only the communicators lwo_nccl_comm_create
// made: any other pointer (never made by lwo, or already destroyed) is
// LWO_ERR_INVALID_HANDLE and is never touched, while a caller's own
// communicator is still accepted by lwo_pool_create_sharded. No device
// needed: every pointer here is refused before NCCL sees it.
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "bindings/c/lwo_test.h"
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

// Destroy functions of registry entries that own nothing.
void forget(void*) {}
void other_forget(void*) {}

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


// lwo_nccl_comm_split's argument checks, on the recording backend (which
// makes no communicators): each refusal is its own status, names the call
// and the value, writes NULL to the output, and touches no parent.
TEST_F(CommTest, SplitRefusesBadArguments) {
  unsigned char parent_bytes[64];
  std::memset(parent_bytes, 0xCD, sizeof parent_bytes);
  auto parent = reinterpret_cast<lwo_nccl_comm_t>(parent_bytes);
  lwo_nccl_comm_t child = parent;  // overwritten with NULL on failure
  EXPECT_EQ(lwo_nccl_comm_split(engine, nullptr, 0, 0, &child), LWO_ERR_INVALID_ARGUMENT);
  std::string m = lwo_last_error_message();
  EXPECT_EQ(m.rfind("lwo_nccl_comm_split: ", 0), 0u) << m;
  EXPECT_NE(m.find("parent communicator is NULL"), std::string::npos) << m;
  EXPECT_EQ(child, nullptr);

  EXPECT_EQ(lwo_nccl_comm_split(engine, parent, -1, 0, &child), LWO_ERR_INVALID_ARGUMENT);
  m = lwo_last_error_message();
  EXPECT_NE(m.find("color -1"), std::string::npos) << m;
  EXPECT_EQ(lwo_nccl_comm_split(engine, parent, 0, 0, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_nccl_comm_split(nullptr, parent, 0, 0, &child), LWO_ERR_INVALID_HANDLE);
  // Arguments that pass reach the backend, which here makes no communicators.
  EXPECT_EQ(lwo_nccl_comm_split(engine, parent, 3, 1, &child), LWO_ERR_UNSUPPORTED);
  m = lwo_last_error_message();
  EXPECT_NE(m.find(pointer_text(parent_bytes)), std::string::npos) << m;
  EXPECT_EQ(child, nullptr);
  for (unsigned char b : parent_bytes) ASSERT_EQ(b, 0xCD);
  // The parent is not lwo's: it is never destroyed by lwo.
  EXPECT_EQ(lwo_nccl_comm_destroy(parent), LWO_ERR_INVALID_HANDLE);
}

// The host backend's one-rank communicators: lwo_nccl_comm_create (of one
// rank) and lwo_nccl_comm_split make them, a sharded pool streams and sums
// gradients through a child whose parent is already destroyed, and each is
// destroyed once.
class HostComm : public EngineTest {
 protected:
  void SetUp() override { ASSERT_LWO(lwo_test_engine_create_host(0, &engine)); }
};

TEST_F(HostComm, CreateRefusesARankOutOfRange) {
  // (Communicators of more than one rank: host_comm_test.cc.)
  lwo_nccl_unique_id id{};
  lwo_nccl_comm_t comm = nullptr;
  EXPECT_EQ(lwo_nccl_comm_create(engine, &id, 1, 1, &comm), LWO_ERR_INVALID_ARGUMENT);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("rank 1 of 1 ranks"), std::string::npos) << m;
  EXPECT_EQ(lwo_nccl_comm_create(engine, &id, 2, -1, &comm), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_nccl_comm_create(engine, &id, 0, 0, &comm), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
}

TEST_F(HostComm, SplitOfAForeignPointerIsRefusedAndLeftAlone) {
  int foreign = 0x1234;
  lwo_nccl_comm_t child = nullptr;
  EXPECT_EQ(lwo_nccl_comm_split(engine, reinterpret_cast<lwo_nccl_comm_t>(&foreign), 0, 0, &child),
            LWO_ERR_UNSUPPORTED);
  EXPECT_EQ(child, nullptr);
  EXPECT_EQ(foreign, 0x1234);
}

TEST_F(HostComm, ASplitChildStreamsAShardedPoolAfterItsParentIsGone) {
  lwo_nccl_unique_id id{};
  lwo_nccl_comm_t parent = nullptr, child = nullptr;
  ASSERT_LWO(lwo_nccl_comm_create(engine, &id, 1, 0, &parent));
  ASSERT_LWO(lwo_nccl_comm_split(engine, parent, 0, 0, &child));
  ASSERT_NE(child, nullptr);
  EXPECT_NE(child, parent);
  ASSERT_LWO(lwo_nccl_comm_destroy(parent));
  EXPECT_EQ(lwo_nccl_comm_destroy(parent), LWO_ERR_INVALID_HANDLE);  // once only

  ModelDesc m(3);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 3, child, nullptr, &pool));
  std::vector<std::vector<uint8_t>> rec(3);
  for (uint32_t l = 0; l < 3; ++l) {
    void* shard = nullptr;
    uint64_t off = 7, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    EXPECT_EQ(off, 0u);
    rec[l].resize(bytes);
    fill_random(rec[l].data(), bytes, 40 + l);
    std::memcpy(shard, rec[l].data(), bytes);
  }
  lwo_ring* ring = make_ring(pool, 2);
  for (uint32_t l : {0u, 1u, 2u, 0u}) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
    ASSERT_EQ(v.record_bytes, rec[l].size());
    EXPECT_EQ(std::memcmp(v.base, rec[l].data(), rec[l].size()), 0) << "layer " << l;
    ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  }
  // Gradients: the sum over one rank is the rank's own.
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
  lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(grads, 1, nullptr, &gv));
  ASSERT_EQ(gv.tensor_dtypes[0], LWO_DTYPE_F32);
  const uint64_t n = (1 % 5 + 1) * 37 * 19;
  auto* g = static_cast<float*>(gv.tensors[0]);
  for (uint64_t i = 0; i < n; ++i) g[i] = 0.25f * static_cast<float>(i % 13);
  auto* gb = static_cast<float*>(gv.tensors[1]);
  for (uint64_t i = 0; i < 74; ++i) gb[i] = -1.0f;
  ASSERT_LWO(lwo_grads_end(grads, 1, nullptr));
  ASSERT_LWO(lwo_grads_wait(grads));
  float* hg = nullptr;
  uint64_t first = 9, count = 0;
  ASSERT_LWO(lwo_grads_shard(grads, 1, "weight", &hg, &first, &count));
  EXPECT_EQ(first, 0u);
  ASSERT_EQ(count, n);
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(hg[i], 0.25f * static_cast<float>(i % 13)) << i;
  ASSERT_LWO(lwo_grads_destroy(grads));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_nccl_comm_destroy(child));
  EXPECT_EQ(lwo_nccl_comm_destroy(child), LWO_ERR_INVALID_HANDLE);
}

// The registry behind lwo_nccl_comm_destroy (engine/comm.h), without NCCL: a
// communicator that was destroyed (taken out of the registry) is refused like
// any foreign pointer.
TEST(CommRegistry, ADestroyedCommunicatorIsInvalidHandle) {
  unsigned char stand_in[16] = {};
  void* comm = stand_in;
  register_comm(comm, forget);
  EXPECT_TRUE(registered_with(comm, forget));
  EXPECT_FALSE(registered_with(comm, other_forget));
  EXPECT_EQ(unregister_comm(comm), forget);    // what lwo_nccl_comm_destroy does first
  EXPECT_EQ(unregister_comm(comm), nullptr);   // a second destroy finds nothing
  EXPECT_FALSE(registered_with(comm, forget));
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
      for (int i = t; i < kComms; i += kThreads) register_comm(&stand_ins[i], forget);
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
