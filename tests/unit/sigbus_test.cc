// The SIGBUS guard of copies out of file mappings (src/common/sigbus.h): a
// read past the end of a file cut short is reported by guarded_copy, every
// time and on any thread; a SIGBUS anywhere else still kills the process.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "checkpoint_files.h"
#include "src/common/sigbus.h"

namespace lwo {
namespace testing {
namespace {

// A file of `pages` pages mapped shared and read-only, then cut to `keep`
// bytes: reading a page past `keep` raises SIGBUS.
struct CutMapping {
  CutMapping(TempFiles& tmp, size_t pages, size_t keep) {
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    bytes = pages * page;
    path = tmp.file("mapped.bin");
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return;
    std::vector<uint8_t> data(bytes, 0x5a);
    ok = write(fd, data.data(), bytes) == static_cast<ssize_t>(bytes);
    void* m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ok = ok && m != MAP_FAILED && ftruncate(fd, static_cast<off_t>(keep)) == 0;
    map = m == MAP_FAILED ? nullptr : static_cast<const uint8_t*>(m);
    close(fd);
  }
  ~CutMapping() {
    if (map) munmap(const_cast<uint8_t*>(map), bytes);
  }
  std::string path;
  size_t page = 0, bytes = 0;
  const uint8_t* map = nullptr;
  bool ok = false;
};

TEST(SigbusGuard, AReadPastTheEndIsReportedEveryTimeOnEveryThread) {
  TempFiles tmp;
  CutMapping cm(tmp, 16, 0);
  ASSERT_TRUE(cm.ok);
  std::vector<uint8_t> dst(cm.bytes);
  // Several times on one thread: the jump out of the handler unblocks
  // SIGBUS again (a second fault with it blocked would kill).
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(guarded_copy(dst.data(), cm.map, cm.bytes), cm.map) << "try " << i;
  // On threads of their own, at once.
  std::vector<std::thread> threads;
  std::vector<const void*> got(4, nullptr);
  for (size_t k = 0; k < got.size(); ++k)
    threads.emplace_back([&, k] {
      std::vector<uint8_t> d(cm.page);
      got[k] = guarded_copy(d.data(), cm.map + k * cm.page, cm.page);
    });
  for (auto& th : threads) th.join();
  for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], cm.map + k * cm.page);
  // A whole mapping copies, and reports nothing.
  std::vector<uint8_t> src(cm.bytes, 0x33);
  EXPECT_EQ(guarded_copy(dst.data(), src.data(), src.size()), nullptr);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

TEST(SigbusGuard, ACopyCutInTheMiddleReportsTheFirstMissingPage) {
  TempFiles tmp;
  CutMapping cm(tmp, 16, 0);
  ASSERT_TRUE(cm.ok);
  // The file grown back to 5 pages: the copy stops at the sixth.
  int fd = open(cm.path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> data(5 * cm.page, 0x77);
  ASSERT_EQ(pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  close(fd);
  std::vector<uint8_t> dst(cm.bytes);
  const void* at = guarded_copy(dst.data(), cm.map, cm.bytes);
  ASSERT_NE(at, nullptr);
  EXPECT_GE(static_cast<const uint8_t*>(at), cm.map + 5 * cm.page);
  EXPECT_LT(static_cast<const uint8_t*>(at), cm.map + 6 * cm.page);
}

// With the handler installed, a fault outside any guarded copy (another
// thread reading the same cut mapping) kills the process with SIGBUS, and so
// does a SIGBUS raised on a thread; the handler chains to the default action.
// How a fault outside the guard ends the process: killed by SIGBUS, or,
// under AddressSanitizer (whose own SIGBUS handler is the one installed
// before ours, to which the fault is handed on), ASan's report and exit 1.
bool died_of_sigbus(int status) {
#if defined(__SANITIZE_ADDRESS__)
  if (WIFEXITED(status) && WEXITSTATUS(status) == 1) return true;
#endif
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
}

TEST(SigbusGuardDeathTest, AFaultOutsideAGuardStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempFiles tmp;
  CutMapping cm(tmp, 4, 0);
  ASSERT_TRUE(cm.ok);
  EXPECT_EXIT(
      {
        install_sigbus_handler();
        std::thread([&] {
          volatile uint8_t x = cm.map[cm.page];
          (void)x;
        }).join();
        std::_Exit(0);
      },
      died_of_sigbus, "");
  EXPECT_EXIT(
      {
        std::vector<uint8_t> d(cm.page);
        (void)guarded_copy(d.data(), cm.map, cm.page);  // installs, and is caught
        std::thread([] { raise(SIGBUS); }).join();
        std::_Exit(0);
      },
      died_of_sigbus, "");
}

// A guarded copy's handler chains to one installed before it.
void previous_handler(int) { std::_Exit(42); }

TEST(SigbusGuardDeathTest, AFaultOutsideAGuardGoesToTheHandlerBefore) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempFiles tmp;
  CutMapping cm(tmp, 4, 0);
  ASSERT_TRUE(cm.ok);
  EXPECT_EXIT(
      {
        signal(SIGBUS, previous_handler);
        std::vector<uint8_t> d(cm.page);
        if (guarded_copy(d.data(), cm.map, cm.page) != cm.map) std::_Exit(1);
        volatile uint8_t x = cm.map[cm.page];
        (void)x;
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(42), "");
}

}  // namespace
}  // namespace testing
}  // namespace lwo
