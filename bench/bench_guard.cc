// The cost of the SIGBUS guard on the staged path's host copy: a layer
// copied out of a file mapping (in the page cache, mapped shared and
// read-only, as a checkpoint is) into a buffer, the way the staged source
// packs it (StagedSource: n parts on lwo::parallel_for, one per 16 MiB, at
// most 8), with plain memcpy and with guarded_copy per part. Reports bytes
// per second; the two should agree within the run's noise. Host only: it
// needs no GPU.
//
//   build/bench/bench_guard [--benchmark_filter=...] [--benchmark_format=json]
//                           [--benchmark_repetitions=5]
//
// The file is made in $TMPDIR (or /tmp) and removed at exit.
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/common/parallel.h"
#include "src/common/sigbus.h"

namespace {

constexpr uint64_t kFileBytes = 512ull << 20;

struct Mapped {
  Mapped() {
    const char* t = std::getenv("TMPDIR");
    path = std::string(t && *t ? t : "/tmp") + "/lwo_bench_guard_XXXXXX";
    int fd = mkstemp(path.data());
    if (fd < 0) return;
    std::vector<uint8_t> chunk(1 << 20);
    for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(i * 131 + 7);
    for (uint64_t o = 0; o < kFileBytes; o += chunk.size())
      if (write(fd, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) return;
    void* m = mmap(nullptr, kFileBytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return;
    map = static_cast<const uint8_t*>(m);
    volatile uint8_t sink = 0;
    for (uint64_t o = 0; o < kFileBytes; o += 4096) sink = sink + map[o];  // map every page
  }
  ~Mapped() {
    if (map) munmap(const_cast<uint8_t*>(map), kFileBytes);
    unlink(path.c_str());
  }
  std::string path;
  const uint8_t* map = nullptr;
};

Mapped& mapped() {
  static Mapped m;
  return m;
}

// One layer of `bytes` copied as StagedSource's run_fill does, from offset 0
// of the mapping (one run; n parts of bytes / n).
void BM_StagedCopy(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0)) << 20;
  const bool guard = state.range(1) != 0;
  Mapped& m = mapped();
  if (!m.map) {
    state.SkipWithError("cannot make the mapped file");
    return;
  }
  std::vector<uint8_t> dst(bytes);
  std::memset(dst.data(), 1, bytes);  // first-touched, as a pinned buffer is
  const uint64_t n = std::min<uint64_t>(8, std::max<uint64_t>(1, bytes >> 24));
  bool faulted = false;
  for (auto _ : state) {
    lwo::parallel_for(n, static_cast<uint32_t>(n), 1, 1, [&](uint64_t pb, uint64_t pe) {
      for (uint64_t part = pb; part < pe; ++part) {
        const uint64_t chunk = (bytes + n - 1) / n;
        const uint64_t b = std::min(bytes, chunk * part), e = std::min(bytes, chunk * (part + 1));
        if (b >= e) continue;
        if (guard)
          faulted |= lwo::guarded_copy(dst.data() + b, m.map + b, e - b) != nullptr;
        else
          std::memcpy(dst.data() + b, m.map + b, e - b);
      }
    });
    benchmark::ClobberMemory();
  }
  if (faulted) state.SkipWithError("a guarded copy faulted");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["parts"] = static_cast<double>(n);
}
BENCHMARK(BM_StagedCopy)
    ->ArgNames({"MiB", "guard"})
    ->ArgsProduct({{4, 16, 64, 256}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One guarded copy against one memcpy, per call, at sizes down to a page:
// what the guard itself costs (a sigsetjmp that saves the signal mask).
void BM_OneCopy(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  const bool guard = state.range(1) != 0;
  Mapped& m = mapped();
  if (!m.map) {
    state.SkipWithError("cannot make the mapped file");
    return;
  }
  std::vector<uint8_t> dst(bytes, 1);
  for (auto _ : state) {
    if (guard)
      benchmark::DoNotOptimize(lwo::guarded_copy(dst.data(), m.map, bytes));
    else
      std::memcpy(dst.data(), m.map, bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_OneCopy)->ArgNames({"bytes", "guard"})->ArgsProduct({{4096, 1 << 20, 4 << 20}, {0, 1}});

}  // namespace

BENCHMARK_MAIN();
