// Sharded pools across processes: two lwo_shard_rank processes (one rank
// each, rank r on CUDA device r, every device visible to both) share one NCCL
// communicator. Each checks its own shard, the slots and its gradient shard
// against references (see tests/gpu/shard_rank.cc); the test checks that both
// exit 0 within a time limit and that their ranges of every tensor together
// cover each element exactly once.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>

#include "gpu_util.h"

extern char** environ;

namespace lwo_test {
namespace {

constexpr int kRanks = 2;
constexpr int kTimeoutS = 120;  // for the whole run of both ranks
constexpr int kGraceS = 20;     // for the others, once one rank has failed

std::string hex_of(const lwo_nccl_unique_id& id) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  for (char ch : id.internal) {
    unsigned char b = static_cast<unsigned char>(ch);
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string temp_path(const std::string& tag, int* fd) {
  const char* dir = std::getenv("TMPDIR");
  std::string tmpl = std::string(dir && *dir ? dir : "/tmp") + "/lwo_shard_rank_" + tag + "_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  *fd = mkstemp(buf.data());
  return *fd >= 0 ? std::string(buf.data()) : std::string();
}

struct RankRun {
  int rank = 0;
  pid_t pid = -1;
  std::string out_path, err_path;
  bool running = false;
  bool exited_ok = false;  // exited by itself with code 0
  std::string ended;       // how it ended, in words
  std::string out, err;
  bool ok() const { return exited_ok; }
};

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return "ended with wait status " + std::to_string(status);
}

// Everything the ranks said, for failure messages.
std::string report(const std::vector<RankRun>& runs) {
  std::string s;
  for (const RankRun& r : runs) {
    s += "\n==== rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) + "): " +
         r.ended + " ====\n---- stdout ----\n" + r.out + "---- stderr ----\n" + r.err;
  }
  return s;
}

// Starts kRanks lwo_shard_rank processes (posix_spawn: no fork of this CUDA
// process) with a fresh communicator id, waits for all of them (kTimeoutS in
// all; kGraceS for the rest once one has failed; then SIGKILL) and collects
// their output.
std::vector<RankRun> run_ranks(uint64_t seed, const std::vector<std::string>& extra) {
  std::vector<RankRun> runs(kRanks);
#ifdef LWO_SHARD_RANK_PATH
  const std::string exe = LWO_SHARD_RANK_PATH;
  lwo_nccl_unique_id id;
  lwo_status_t s = lwo_nccl_get_unique_id(&id);
  EXPECT_EQ(LWO_OK, s) << "lwo_nccl_get_unique_id: " << lwo_last_error_message();
  if (s != LWO_OK) return {};
  const std::string id_hex = hex_of(id);

  // The environment, with NVLink SHARP off unless the caller chose otherwise.
  std::vector<std::string> env_strings;
  bool have_nvls = false;
  for (char** e = environ; e && *e; ++e) {
    env_strings.emplace_back(*e);
    if (env_strings.back().rfind("NCCL_NVLS_ENABLE=", 0) == 0) have_nvls = true;
  }
  if (!have_nvls) env_strings.emplace_back("NCCL_NVLS_ENABLE=0");
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(&e[0]);
  envp.push_back(nullptr);

  for (int r = 0; r < kRanks; ++r) {
    RankRun& run = runs[r];
    run.rank = r;
    int out_fd = -1, err_fd = -1;
    run.out_path = temp_path("out", &out_fd);
    run.err_path = temp_path("err", &err_fd);
    if (out_fd < 0 || err_fd < 0) {
      ADD_FAILURE() << "mkstemp: " << std::strerror(errno);
      if (out_fd >= 0) close(out_fd);
      if (err_fd >= 0) close(err_fd);
      run.ended = "not started (no temporary file)";
      continue;
    }
    std::vector<std::string> args = {exe,    "--rank", std::to_string(r), "--ranks",
                                     std::to_string(kRanks), "--id", id_hex, "--seed",
                                     std::to_string(seed)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(&a[0]);
    argv.push_back(nullptr);

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
    posix_spawn_file_actions_adddup2(&fa, err_fd, 2);
    posix_spawn_file_actions_addclose(&fa, out_fd);
    posix_spawn_file_actions_addclose(&fa, err_fd);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    int e = posix_spawn(&run.pid, exe.c_str(), &fa, &attr, argv.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&fa);
    close(out_fd);
    close(err_fd);
    if (e != 0) {
      ADD_FAILURE() << "posix_spawn " << exe << " (rank " << r << "): " << std::strerror(e);
      run.pid = -1;
      run.ended = "not started";
      continue;
    }
    run.running = true;
  }

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto deadline = start + std::chrono::seconds(kTimeoutS);
  std::string why_killed = "did not finish within " + std::to_string(kTimeoutS) + " s (hung?); killed";
  for (;;) {
    bool any = false;
    for (RankRun& run : runs) {
      if (!run.running) continue;
      int st = 0;
      pid_t w = waitpid(run.pid, &st, WNOHANG);
      if (w == 0 || (w < 0 && errno == EINTR)) {
        any = true;
        continue;
      }
      run.running = false;
      if (w < 0) {
        run.ended = std::string("waitpid failed: ") + std::strerror(errno);
      } else {
        run.exited_ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        run.ended = describe(st);
      }
      if (!run.ok()) {
        auto grace = Clock::now() + std::chrono::seconds(kGraceS);
        if (grace < deadline) {
          deadline = grace;
          why_killed = "still running " + std::to_string(kGraceS) + " s after rank " +
                       std::to_string(run.rank) + " failed (waiting for it in a collective?); killed";
        }
      }
    }
    if (!any) break;
    if (Clock::now() >= deadline) {
      for (RankRun& run : runs) {
        if (!run.running) continue;
        kill(run.pid, SIGKILL);
        int st = 0;
        while (waitpid(run.pid, &st, 0) < 0 && errno == EINTR) {
        }
        run.running = false;
        run.ended = why_killed;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (RankRun& run : runs) {
    if (!run.out_path.empty()) {
      run.out = read_file(run.out_path);
      unlink(run.out_path.c_str());
    }
    if (!run.err_path.empty()) {
      run.err = read_file(run.err_path);
      unlink(run.err_path.c_str());
    }
  }
#else
  (void)seed;
  (void)extra;
#endif
  return runs;
}

// Both ranks ran every check and exited 0.
void expect_success(const std::vector<RankRun>& runs) {
  ASSERT_EQ(static_cast<size_t>(kRanks), runs.size());
  for (const RankRun& r : runs) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " " << r.ended;
    if (r.ok()) {
      EXPECT_NE(std::string::npos, r.out.find("DONE rank " + std::to_string(r.rank)))
          << "rank " << r.rank << " exited 0 without reporting DONE";
    }
  }
}

// On any failure of the test, one more with everything the ranks printed.
#define LWO_REPORT_RANKS_ON_FAILURE(runs)                                        \
  auto report_guard_ = defer([&] {                                              \
    if (::testing::Test::HasFailure()) ADD_FAILURE() << "the ranks' output:" << report(runs); \
  })

// The lines "<kind> layer name first n numel" of every rank: for each tensor,
// each rank reports once, all agree on numel, and the ranks' ranges, in rank
// order, tile [0, numel) (rank r's elements come right after rank r-1's).
void expect_ranges_cover(const std::vector<RankRun>& runs, const std::string& kind) {
  struct Part {
    int rank;
    uint64_t first, n, numel;
  };
  std::map<std::pair<uint32_t, std::string>, std::vector<Part>> tensors;
  for (const RankRun& r : runs) {
    std::istringstream lines(r.out);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream ls(line);
      std::string k, name;
      uint32_t layer = 0;
      unsigned long long first = 0, n = 0, numel = 0;
      if (!(ls >> k) || k != kind) continue;
      ASSERT_TRUE(static_cast<bool>(ls >> layer >> name >> first >> n >> numel))
          << "rank " << r.rank << ": bad line \"" << line << "\"";
      tensors[{layer, name}].push_back({r.rank, first, n, numel});
    }
  }
  // 7 layers of a weight and a bias (tests/gpu/shard_rank.cc).
  EXPECT_EQ(14u, tensors.size()) << kind << ": tensors reported";
  for (const auto& kv : tensors) {
    const std::string what = "tensor '" + kv.first.second + "' of layer " +
                             std::to_string(kv.first.first) + " (" + kind + " lines)";
    std::vector<Part> parts = kv.second;
    ASSERT_EQ(static_cast<size_t>(kRanks), parts.size()) << what << ": reports";
    std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.rank < b.rank; });
    uint64_t next = 0;
    for (int q = 0; q < kRanks; ++q) {
      const Part& p = parts[q];
      EXPECT_EQ(q, p.rank) << what << ": two reports from one rank";
      EXPECT_EQ(parts[0].numel, p.numel) << what << ": the ranks disagree on the element count";
      if (p.n == 0) continue;
      EXPECT_EQ(next, p.first) << what << ": rank " << q << " holds [" << p.first << ", "
                               << p.first + p.n << "); the elements before it end at " << next
                               << " (a gap or an overlap)";
      next = p.first + p.n;
    }
    EXPECT_EQ(parts[0].numel, next) << what << ": the ranks' ranges end at " << next << " of "
                                    << parts[0].numel << " elements";
  }
}

// Both kinds of range name the same elements.
void expect_grad_ranges_are_pool_ranges(const std::vector<RankRun>& runs) {
  for (const RankRun& r : runs) {
    std::vector<std::string> pool, grad;
    std::istringstream lines(r.out);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.rfind("POOLRANGE ", 0) == 0) pool.push_back(line.substr(10));
      if (line.rfind("GRADRANGE ", 0) == 0) grad.push_back(line.substr(10));
    }
    std::sort(pool.begin(), pool.end());
    std::sort(grad.begin(), grad.end());
    EXPECT_EQ(pool, grad) << "rank " << r.rank
                          << ": lwo_grads_shard and lwo_pool_shard_tensor give different ranges";
  }
}

#define LWO_REQUIRE_TWO_GPUS()                                                              \
  do {                                                                                      \
    LWO_REQUIRE_GPU();                                                                      \
    if (device_count() < kRanks)                                                            \
      GTEST_SKIP() << "needs " << kRanks << " CUDA devices, found " << device_count();     \
  } while (0)

#ifdef LWO_SHARD_RANK_PATH
#define LWO_REQUIRE_RANK_PROGRAM() \
  do {                             \
  } while (0)
#else
#define LWO_REQUIRE_RANK_PROGRAM() \
  GTEST_SKIP() << "built without LWO_SHARD_RANK_PATH (the lwo_shard_rank program)"
#endif

// Both ranks run with `extra` and succeed; the ranges of the records and of
// the gradients they report cover every tensor, and agree.
void expect_ranks_hold_the_records(uint64_t seed, const std::vector<std::string>& extra) {
  std::vector<RankRun> runs = run_ranks(seed, extra);
  LWO_REPORT_RANKS_ON_FAILURE(runs);
  ASSERT_NO_FATAL_FAILURE(expect_success(runs));
  if (::testing::Test::HasFailure()) return;
  expect_ranges_cover(runs, "POOLRANGE");
  expect_ranges_cover(runs, "GRADRANGE");
  expect_grad_ranges_are_pool_ranges(runs);
}

TEST(ShardedProcesses, TwoRanksHoldTheRecordsAndSumTheGradients) {
  LWO_REQUIRE_TWO_GPUS();
  LWO_REQUIRE_RANK_PROGRAM();
  expect_ranks_hold_the_records(test_seed(81), {});
}

TEST(ShardedProcesses, TwoRanksWithCheckedCollectives) {
  LWO_REQUIRE_TWO_GPUS();
  LWO_REQUIRE_RANK_PROGRAM();
  expect_ranks_hold_the_records(test_seed(82), {"--check"});
}

// Rank 1 describes a layer with a different record size: both ranks are
// refused by lwo_pool_create_sharded (LWO_ERR_COLLECTIVE_MISMATCH, a message
// naming the call) instead of hanging later in a collective.
TEST(ShardedProcesses, RanksThatDescribeDifferentLayersAreRefused) {
  LWO_REQUIRE_TWO_GPUS();
  LWO_REQUIRE_RANK_PROGRAM();
  std::vector<RankRun> runs = run_ranks(test_seed(83), {"--mismatch", "pool"});
  LWO_REPORT_RANKS_ON_FAILURE(runs);
  ASSERT_NO_FATAL_FAILURE(expect_success(runs));
  for (const RankRun& r : runs)
    EXPECT_NE(std::string::npos, r.out.find("POOL_MISMATCH LWO_ERR_COLLECTIVE_MISMATCH"))
        << "rank " << r.rank;
}

// With LWO_ENGINE_CHECK_COLLECTIVES, rank 0 stages one layer and rank 1
// another: both get LWO_ERR_COLLECTIVE_MISMATCH from lwo_ring_stage, and the
// ring and everything after it (the rest of the run) work as before.
TEST(ShardedProcesses, CheckedCollectivesRefuseDifferentStages) {
  LWO_REQUIRE_TWO_GPUS();
  LWO_REQUIRE_RANK_PROGRAM();
  std::vector<RankRun> runs = run_ranks(test_seed(84), {"--check", "--mismatch", "stage"});
  LWO_REPORT_RANKS_ON_FAILURE(runs);
  ASSERT_NO_FATAL_FAILURE(expect_success(runs));
  for (const RankRun& r : runs)
    EXPECT_NE(std::string::npos, r.out.find("STAGE_MISMATCH LWO_ERR_COLLECTIVE_MISMATCH"))
        << "rank " << r.rank;
  if (HasFailure()) return;
  expect_ranges_cover(runs, "POOLRANGE");
  expect_ranges_cover(runs, "GRADRANGE");
}

}  // namespace
}  // namespace lwo_test
