// The engine's host memory budget: the derived limit, charges, the status.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "bindings/c/lwo_test.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;

// A fake root: ROOT/proc and ROOT/sys/fs/cgroup, with files written on demand.
struct FakeRoot {
  std::string root;
  FakeRoot() {
    char tmpl[] = "/tmp/lwo_host_root_XXXXXX";
    root = mkdtemp(tmpl);
    for (const char* d : {"/proc", "/proc/self", "/sys", "/sys/fs", "/sys/fs/cgroup",
                          "/sys/fs/cgroup/memory"})
      mkdir((root + d).c_str(), 0755);
  }
  ~FakeRoot() { std::system(("rm -rf " + root).c_str()); }
  void write(const char* rel, const std::string& text) const {
    std::FILE* f = std::fopen((root + rel).c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  std::string proc() const { return root + "/proc"; }
  std::string cgroup() const { return root + "/sys/fs/cgroup"; }
};

std::string meminfo_kb(uint64_t available_kb) {
  return "MemTotal:       99999999 kB\nMemFree:         1000 kB\nMemAvailable:   " +
         std::to_string(available_kb) + " kB\n";
}

TEST(HostLimit, DerivedFromCgroupAndMeminfo) {
  FakeRoot r;
  auto derived = [&] { return derive_host_limit(r.proc().c_str(), r.cgroup().c_str()); };
  // Nothing known: no limit.
  EXPECT_EQ(derived(), 0u);
  // MemAvailable 8 GiB, less an eighth.
  r.write("/proc/meminfo", meminfo_kb(8 * 1024 * 1024));
  EXPECT_EQ(derived(), 7 * 1024 * kMiB);
  // cgroup v2 "max" is no limit; a number below MemAvailable wins (margin 256 MiB).
  r.write("/sys/fs/cgroup/memory.max", "max\n");
  EXPECT_EQ(derived(), 7 * 1024 * kMiB);
  r.write("/sys/fs/cgroup/memory.max", std::to_string(1024 * kMiB) + "\n");
  EXPECT_EQ(derived(), 768 * kMiB);
  // cgroup v1, smaller still (the margin is at most half).
  r.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(300 * kMiB) + "\n");
  EXPECT_EQ(derived(), 150 * kMiB);
  // CAP_IPC_LOCK or not, the limit is the same (RLIMIT_MEMLOCK is no term).
  r.write("/proc/self/status", "Name:\tx\nCapEff:\t0000000000000000\n");
  EXPECT_EQ(derived(), 150 * kMiB);
}

TEST(HostLimit, EngineTakesTheDerivedLimitFromTheTestRoot) {
  FakeRoot r;
  r.write("/proc/meminfo", meminfo_kb(2 * 1024 * 1024));  // 2 GiB: limit 1.75 GiB
  r.write("/proc/self/status", "CapEff:\t000001ffffffffff\n");
  setenv("LWO_TEST_HOST_ROOT", r.root.c_str(), 1);
  lwo_engine* e = nullptr;
  lwo_status_t s = lwo_test_engine_create_host(0, &e);
  unsetenv("LWO_TEST_HOST_ROOT");
  ASSERT_EQ(s, LWO_OK) << lwo_last_error_message();
  uint64_t limit = 0, charged = 1;
  ASSERT_LWO(lwo_engine_host_usage(e, &limit, &charged));
  EXPECT_EQ(limit, 1792 * kMiB);
  EXPECT_EQ(charged, 0u);
  ASSERT_LWO(lwo_engine_set_host_limit(e, LWO_HOST_LIMIT_NONE));
  ASSERT_LWO(lwo_engine_host_usage(e, &limit, nullptr));
  EXPECT_EQ(limit, 0u);
  ASSERT_LWO(lwo_engine_destroy(e));
}

// One layer of `bytes` bytes of u8.
struct OneLayer {
  lwo_tensor_desc t;
  lwo_layer_desc layer;
  explicit OneLayer(uint64_t bytes, const void* host = nullptr) {
    t = tensor("w", LWO_DTYPE_U8, {static_cast<int64_t>(bytes)}, host);
    layer = lwo_layer_desc{&t, 1, nullptr};
  }
};

TEST(HostBudget, OverBudgetPoolFailsWithTheBytesAndLeavesTheEngineUsable) {
  lwo_engine* e = nullptr;
  ASSERT_LWO(lwo_test_engine_create_host(0, &e));
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  ASSERT_LWO(lwo_engine_set_host_limit(e, 4 * page));
  OneLayer big(4 * page + 1);
  lwo_pool* pool = nullptr;
  ASSERT_EQ(lwo_pool_create_pinned(e, &big.layer, 1, nullptr, &pool), LWO_ERR_OVER_BUDGET);
  EXPECT_EQ(pool, nullptr);
  std::string msg = lwo_last_error_message();
  EXPECT_NE(msg.find("lwo_pool_create_pinned"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(5 * page) + " bytes of host memory asked"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("0 bytes charged"), std::string::npos) << msg;
  EXPECT_NE(msg.find("host limit " + std::to_string(4 * page)), std::string::npos) << msg;
  uint64_t charged = 1;
  ASSERT_LWO(lwo_engine_host_usage(e, nullptr, &charged));
  EXPECT_EQ(charged, 0u);
  // Usable: a pool that fits is made and charged whole pages, then released.
  OneLayer small(page + 1);
  ASSERT_LWO(lwo_pool_create_pinned(e, &small.layer, 1, nullptr, &pool));
  ASSERT_LWO(lwo_engine_host_usage(e, nullptr, &charged));
  EXPECT_EQ(charged, 2 * page);
  // A limit below what is charged is refused.
  EXPECT_EQ(lwo_engine_set_host_limit(e, page), LWO_ERR_OVER_BUDGET);
  // The second pool passes the limit too: 2 + 3 pages > 4.
  OneLayer mid(2 * page + 1);
  lwo_pool* pool2 = nullptr;
  EXPECT_EQ(lwo_pool_create_pinned(e, &mid.layer, 1, nullptr, &pool2), LWO_ERR_OVER_BUDGET);
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_host_usage(e, nullptr, &charged));
  EXPECT_EQ(charged, 0u);
  ASSERT_LWO(lwo_pool_create_pinned(e, &mid.layer, 1, nullptr, &pool2));
  ASSERT_LWO(lwo_pool_destroy(pool2));
  ASSERT_LWO(lwo_engine_destroy(e));
}

TEST(HostBudget, RegisteredPoolIsCharged) {
  lwo_engine* e = nullptr;
  ASSERT_LWO(lwo_test_engine_create_host(0, &e));
  ASSERT_LWO(lwo_engine_set_host_limit(e, 1000));
  std::vector<uint8_t> mem(4096);
  OneLayer l(2048, mem.data());
  lwo_host_region region{mem.data(), mem.size(), nullptr};
  lwo_pool* pool = nullptr;
  lwo_status_t s = lwo_pool_create_registered(e, &l.layer, 1, &region, 1, nullptr, &pool);
  EXPECT_EQ(s, LWO_ERR_OVER_BUDGET) << lwo_last_error_message();
  ASSERT_LWO(lwo_engine_set_host_limit(e, 4096));
  ASSERT_LWO(lwo_pool_create_registered(e, &l.layer, 1, &region, 1, nullptr, &pool));
  uint64_t charged = 0;
  ASSERT_LWO(lwo_engine_host_usage(e, nullptr, &charged));
  EXPECT_EQ(charged, 4096u);  // the region, whole
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_host_usage(e, nullptr, &charged));
  EXPECT_EQ(charged, 0u);
  ASSERT_LWO(lwo_engine_destroy(e));
}

// A child with RLIMIT_MEMLOCK of 1 MiB and no CAP_IPC_LOCK (a fake
// /proc/self/status) creates a 4 MiB pool: CUDA's pinning is not charged
// against the limit, so lwo does not refuse it. Under a memory cgroup of
// 2 MiB (a fake memory.max: a limit of 1 MiB) the same pool gets the status
// and the child exits with it; it is not killed.
int pool_in_child(const FakeRoot& r, bool small_memlock) {
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (small_memlock) {
      struct rlimit rl {1 << 20, 1 << 20};
      if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) _exit(90);
    }
    setenv("LWO_TEST_HOST_ROOT", r.root.c_str(), 1);
    lwo_engine* e = nullptr;
    if (lwo_test_engine_create_host(0, &e) != LWO_OK) _exit(91);
    OneLayer big(4 << 20);
    lwo_pool* pool = nullptr;
    lwo_status_t s = lwo_pool_create_pinned(e, &big.layer, 1, nullptr, &pool);
    if (s == LWO_OK) lwo_pool_destroy(pool);
    lwo_engine_destroy(e);
    _exit(s == LWO_ERR_OVER_BUDGET ? 42 : s == LWO_OK ? 0 : 92);
  }
  int st = 0;
  if (waitpid(pid, &st, 0) != pid) return -2;
  if (!WIFEXITED(st)) return 1000 + WTERMSIG(st);
  return WEXITSTATUS(st);
}

TEST(HostBudget, SmallMemlockRefusesNothingSmallCgroupGivesTheStatus) {
  FakeRoot r;
  r.write("/proc/meminfo", meminfo_kb(64 * 1024 * 1024));
  r.write("/proc/self/status", "CapEff:\t0000000000000000\n");
  EXPECT_EQ(pool_in_child(r, true), 0) << "42: RLIMIT_MEMLOCK refused the pool; >1000: killed";
  r.write("/sys/fs/cgroup/memory.max", std::to_string(2 * kMiB) + "\n");
  EXPECT_EQ(pool_in_child(r, false), 42) << "0: the pool was made past the cgroup; >1000: killed";
}

}  // namespace
}  // namespace testing
}  // namespace lwo
