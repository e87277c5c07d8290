// The host thread pool (src/common/thread_pool.h): every part and item runs
// once, on a fixed slot, calls from inside its tasks run inline (no
// deadlock), exceptions reach the caller after every part is done, a slowed
// thread holds up no shared call, a forked child works alone, and the
// destructor joins its threads.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "src/common/parallel.h"
#include "src/common/thread_pool.h"

namespace lwo {
namespace {

// Aborts the test program if the scope is not left within `seconds` (a
// deadlock fails the test instead of hanging the run).
class Watchdog {
 public:
  explicit Watchdog(const char* what, int seconds = 60) {
    thread_ = std::thread([this, what, seconds] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [&] { return done_; })) {
        std::fprintf(stderr, "watchdog: %s did not return within %d s\n", what, seconds);
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

int threads_of_process() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

void pause_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(ThreadPool, RunsEveryPartOnceOnAFixedSlot) {
  ThreadPool pool(4);
  ASSERT_EQ(pool.size(), 4u);
  std::vector<std::thread::id> first(4);
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<std::thread::id> ran(4);
    std::vector<int> done(4, 0);
    pool.run(4, [&](uint32_t p) {
      pause_ms(5);  // the caller must wait for the slow parts
      ran[p] = std::this_thread::get_id();
      ++done[p];
    });
    EXPECT_EQ(done, std::vector<int>(4, 1)) << "rep " << rep;
    EXPECT_EQ(ran[0], std::this_thread::get_id());  // part 0 is the caller's
    EXPECT_EQ(std::set<std::thread::id>(ran.begin(), ran.end()).size(), 4u);
    if (rep == 0) first = ran;
    EXPECT_EQ(ran, first) << "rep " << rep;  // part p on the same thread every call
  }
  // Fewer parts, placed by a fixed spread: part p where it is in 4 parts.
  std::vector<std::thread::id> ran(2);
  pool.run(2, [&](uint32_t p) { ran[p] = std::this_thread::get_id(); }, 4);
  EXPECT_EQ(ran[0], first[0]);
  EXPECT_EQ(ran[1], first[1]);
}

TEST(ThreadPool, MorePartsThanSlotsAndEveryItemOnce) {
  ThreadPool pool(2);
  for (uint32_t parts : {1u, 2u, 3u, 7u, 64u}) {
    std::vector<std::atomic<int>> hits(parts);
    pool.run(parts, [&](uint32_t p) {
      pause_ms(1);
      hits[p].fetch_add(1);
    });
    for (uint32_t p = 0; p < parts; ++p) ASSERT_EQ(hits[p].load(), 1) << parts << " parts";
  }
  for (uint64_t items : {uint64_t{1}, uint64_t{5}, uint64_t{1000}}) {
    std::vector<std::atomic<int>> hits(items);
    pool.share(8, items, [&](uint64_t i) {
      if (i % 100 == 0) pause_ms(2);
      hits[i].fetch_add(1);
    });
    for (uint64_t i = 0; i < items; ++i) ASSERT_EQ(hits[i].load(), 1) << items << " items";
  }
}

// As a staged pack cuts a layer (engine/source.cc): n parts, taken in turn,
// each its own chunk [k, k + 1).
TEST(ThreadPool, PartsTakenInTurnAreTheStaticParts) {
  ThreadPool pool(3);
  for (uint64_t n = 1; n <= 8; ++n) {
    std::vector<std::atomic<int>> hits(n);
    std::atomic<int> wide{0};
    parallel_for(
        pool, n, static_cast<uint32_t>(n), 1, 1,
        [&](uint64_t b, uint64_t e) {
          if (e != b + 1) wide.fetch_add(1);
          pause_ms(1);
          hits[b].fetch_add(1);
        },
        2);
    EXPECT_EQ(wide.load(), 0) << n;
    for (uint64_t k = 0; k < n; ++k) ASSERT_EQ(hits[k].load(), 1) << "n " << n << " part " << k;
  }
}

TEST(ThreadPool, NestedCallsRunInlineWithoutDeadlock) {
  Watchdog dog("nested parallel_for");
  ThreadPool pool(3);
  const uint64_t n = 4096, m = 512;
  std::vector<std::atomic<int>> hits(n * m);
  // Every outer part (on every slot at once) calls the pool again, static
  // and in turn, twice deep.
  parallel_for(pool, n, 3, 1, 1, [&](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) {
      parallel_for(pool, m, 3, 1, 1, [&](uint64_t ib, uint64_t ie) {
        parallel_for(
            pool, ie - ib, 3, 1, 1,
            [&](uint64_t jb, uint64_t je) {
              for (uint64_t j = jb; j < je; ++j) hits[i * m + ib + j].fetch_add(1);
            },
            4);
      });
    }
  });
  for (uint64_t k = 0; k < n * m; ++k) ASSERT_EQ(hits[k].load(), 1) << k;
}

TEST(ThreadPool, ConcurrentCallersShareTheThreads) {
  Watchdog dog("concurrent callers");
  ThreadPool pool(3);
  std::atomic<uint64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 200; ++rep) {
        std::atomic<uint64_t> local{0};
        if ((rep + c) % 2)
          pool.run(5, [&](uint32_t p) { local.fetch_add(p + 1); });
        else
          pool.share(3, 5, [&](uint64_t i) { local.fetch_add(i + 1); });
        EXPECT_EQ(local.load(), 15u);
        sum.fetch_add(local.load());
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4u * 200u * 15u);
}

TEST(ThreadPool, ExceptionsReachTheCallerAfterEveryPart) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(6);
  try {
    pool.run(6, [&](uint32_t p) {
      if (p == 4) throw std::runtime_error("part 4");
      pause_ms(5);
      hits[p].fetch_add(1);
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "part 4");
  }
  for (uint32_t p = 0; p < 6; ++p) EXPECT_EQ(hits[p].load(), p == 4 ? 0 : 1) << p;
  std::atomic<int> items{0};
  EXPECT_THROW(pool.share(3, 100,
                          [&](uint64_t i) {
                            items.fetch_add(1);
                            if (i == 0) throw std::invalid_argument("item 0");
                          }),
               std::invalid_argument);
  EXPECT_EQ(items.load(), 100);
  EXPECT_THROW(parallel_for(pool, 1 << 20, 3, 1, 1,
                            [&](uint64_t b, uint64_t) {
                              if (b > 0) throw std::out_of_range("not the first");
                            }),
               std::out_of_range);
  // The pool works on after a throw.
  std::atomic<int> after{0};
  pool.run(3, [&](uint32_t) { after.fetch_add(1); });
  EXPECT_EQ(after.load(), 3);
}

// A thread busy with another caller's long part holds up no call whose items
// are taken in turn: the caller takes them all.
TEST(ThreadPool, ABusyThreadHoldsUpNoSharedCall) {
  Watchdog dog("shared call beside a busy thread");
  ThreadPool pool(2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  std::thread blocker([&] {
    pool.run(2, [&](uint32_t p) {
      if (p != 1) return;
      std::unique_lock<std::mutex> lock(mu);
      started = true;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
    });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return started; });  // slot 1 is now busy
  }
  std::atomic<int> hits{0};
  parallel_for(
      pool, 1000, 2, 1, 1, [&](uint64_t b, uint64_t e) { hits.fetch_add(static_cast<int>(e - b)); },
      8);
  EXPECT_EQ(hits.load(), 1000);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  blocker.join();
}

TEST(ThreadPool, DestructionJoinsItsThreads) {
  const int before = threads_of_process();
  {
    ThreadPool pool(5);
    EXPECT_EQ(threads_of_process(), before + 4);
    std::atomic<int> n{0};
    pool.run(5, [&](uint32_t) { n.fetch_add(1); });
    EXPECT_EQ(n.load(), 5);
    HostThread t = pool.start([&] { n.fetch_add(1); });
    t.join();
    EXPECT_EQ(n.load(), 6);
    t = pool.start([] { pause_ms(20); });  // joined by the handle's destructor
  }
  EXPECT_EQ(threads_of_process(), before);
}

TEST(ThreadPool, AForkedChildWorksAlone) {
  ThreadPool& pool = ThreadPool::process();
  parallel_for(pool, 1 << 16, 0, 1, 1, [](uint64_t, uint64_t) {});  // the threads exist
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(30);  // a hang ends the child
    std::vector<int> hits(1 << 16, 0);
    parallel_for(pool, hits.size(), 4, 1, 1, [&](uint64_t b, uint64_t e) {
      for (uint64_t i = b; i < e; ++i) ++hits[i];
    });
    parallel_for(
        hits.size(), 4, 1, 1,
        [&](uint64_t b, uint64_t e) {
          for (uint64_t i = b; i < e; ++i) ++hits[i];
        },
        8);
    for (int h : hits)
      if (h != 2) _exit(1);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ThreadPool, CpulistParser) {
  EXPECT_EQ(parse_cpulist("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpulist("5"), (std::vector<int>{5}));
  EXPECT_TRUE(parse_cpulist("3-1").empty());
  EXPECT_TRUE(parse_cpulist("x").empty());
  const auto nodes = numa_nodes();
  ASSERT_FALSE(nodes.empty());
  for (const auto& nd : nodes) EXPECT_FALSE(nd.cpus.empty());
  ThreadPool pool(3);
  EXPECT_EQ(pool.n_nodes(), nodes.size());
  for (uint32_t s = 0; s < pool.size(); ++s) {
    bool known = false;
    for (const auto& nd : nodes) known |= nd.id == pool.node_of(s);
    EXPECT_TRUE(known) << "slot " << s;
  }
}

}  // namespace
}  // namespace lwo
