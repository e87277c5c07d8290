// bench_copy: raw copy bandwidth between host and device memory by copy size,
// for pinned (cudaHostAlloc), registered (page-aligned malloc +
// cudaHostRegister) and pageable (plain malloc) host memory; host to device,
// device to host, and both at once on two streams.
//
// One iteration is a batch of back-to-back copies of one size on one stream
// (at least 256 MiB, or one copy if larger), timed with CUDA events; one
// untimed batch warms up first. Counters:
//   GB/s           bytes / median batch time, 1e9 B/s ("both": both directions)
//   GB/s_best      the same for the fastest batch
//   share_of_peak  GB/s over the pinned H2D peak this process measured first
//   h2d_GB/s, d2h_GB/s   ("both" only) each direction over its own time
//   bytes          the copy size
//
// Names: copy/<memory>/<direction>/bytes:<size>. Runs in about 30 s on an H200.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "bench/common.h"

namespace lwob {
namespace {

constexpr uint64_t kMaxBytes = 1 * GiB;
constexpr uint64_t kBatchBytes = 256 * MiB;
constexpr int kIterations = 5;

enum class Memory { kPinned, kRegistered, kPageable };
using testkit::Direction;

const char* memory_name(Memory m) {
  static const char* const kNames[] = {"pinned", "registered", "pageable"};
  return kNames[static_cast<int>(m)];
}

// Two host buffers of kMaxBytes of one kind (the H2D source and the D2H
// destination), touched before use so no page fault is timed.
class HostBuffers {
 public:
  explicit HostBuffers(Memory kind) : kind_(kind) {
    for (int i = 0; i < 2; ++i) {
      void* p = nullptr;
      if (kind == Memory::kPinned) {
        pinned_[i] = pinned_alloc(kMaxBytes);
        p = pinned_[i].get();
      } else {
        if (posix_memalign(&p, 4096, kMaxBytes) != 0)
          fail(strf("posix_memalign(%s) failed", fmt_bytes(kMaxBytes).c_str()));
        plain_[i].reset(p);
        if (kind == Memory::kRegistered) (void)madvise(p, kMaxBytes, MADV_HUGEPAGE);
      }
      std::memset(p, 0x5a, kMaxBytes);
      if (kind == Memory::kRegistered) {
        check(cudaHostRegister(p, kMaxBytes, cudaHostRegisterDefault), "cudaHostRegister");
        registered_[i] = testkit::Registration(p);
      }
      p_[i] = p;
    }
  }
  Memory kind() const { return kind_; }
  void* src() const { return p_[0]; }
  void* dst() const { return p_[1]; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  Memory kind_;
  void* p_[2] = {nullptr, nullptr};
  PinnedMem pinned_[2];
  std::unique_ptr<void, Free> plain_[2];
  testkit::Registration registered_[2];  // unregistered before plain_ is freed
};

// Resources kept across benchmarks (registered memory-kind-major, so one kind
// of host buffers at a time); freed by cleanup().
struct Shared {
  std::unique_ptr<HostBuffers> host;
  DeviceMem dev[2];
  std::unique_ptr<testkit::CopyLoop> loop;
};
std::unique_ptr<Shared> g_shared;

Shared& shared(Memory kind) {
  if (!g_shared) g_shared = std::make_unique<Shared>();
  Shared& s = *g_shared;
  if (!s.loop) {
    s.dev[0] = device_alloc(kMaxBytes);
    s.dev[1] = device_alloc(kMaxBytes);
    check(cudaMemset(s.dev[0].get(), 0, kMaxBytes), "cudaMemset");
    check(cudaMemset(s.dev[1].get(), 0, kMaxBytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // not ordered with our streams
    s.loop = std::make_unique<testkit::CopyLoop>();
  }
  if (!s.host || s.host->kind() != kind) {
    s.host.reset();  // free the other kind first
    s.host = std::make_unique<HostBuffers>(kind);
  }
  return s;
}

void cleanup() { g_shared.reset(); }

void bm_copy(benchmark::State& state, Memory kind, Direction dir) {
  run_guarded(state, [&] {
    const uint64_t bytes = static_cast<uint64_t>(state.range(0));
    const uint64_t copies = std::max<uint64_t>(1, kBatchBytes / bytes);
    const uint64_t moved = bytes * copies * (dir == Direction::kBoth ? 2 : 1);
    Shared& s = shared(kind);
    const testkit::CopyPlan plan = testkit::uniform_plan(
        dir, s.host->src(), s.host->dst(), s.dev[0].get(), s.dev[1].get(), bytes, copies);
    s.loop->run_batch(plan);  // warm-up
    testkit::CopyResult r;
    r.direction = dir;
    r.h2d_bytes = plan.h2d_bytes();
    r.d2h_bytes = plan.d2h_bytes();
    for (auto _ : state) {
      r.batches.push_back(s.loop->run_batch(plan));
      state.SetIterationTime(r.batches.back().ms / 1e3);
    }
    const double med = r.median_gbps();
    state.counters["GB/s"] = med;
    state.counters["GB/s_best"] = r.best_gbps();
    state.counters["share_of_peak"] = peaks().h2d_gbps > 0 ? med / peaks().h2d_gbps : 0;
    state.counters["bytes"] = static_cast<double>(bytes);
    state.counters["copies_per_batch"] = static_cast<double>(copies);
    if (dir == Direction::kBoth) {
      state.counters["h2d_GB/s"] = r.h2d_median_gbps();
      state.counters["d2h_GB/s"] = r.d2h_median_gbps();
    }
    state.SetBytesProcessed(static_cast<int64_t>(moved) * state.iterations());
  });
}

void register_benchmarks() {
  for (Memory m : {Memory::kPinned, Memory::kRegistered, Memory::kPageable})
    for (Direction d : {Direction::kH2D, Direction::kD2H, Direction::kBoth}) {
      std::string name = strf("copy/%s/%s", memory_name(m), testkit::direction_name(d));
      auto* b = benchmark::RegisterBenchmark(name.c_str(),
                                             [m, d](benchmark::State& st) { bm_copy(st, m, d); });
      for (uint64_t bytes = 256 * KiB; bytes <= kMaxBytes; bytes *= 4)
        b->Arg(static_cast<int64_t>(bytes));
      timed_ms(b->ArgName("bytes"), kIterations);
    }
}

}  // namespace

const MainSpec kMain = {
    "bench_copy",
    "host<->device copy bandwidth by size: pinned, registered, pageable; H2D, D2H, both",
    register_benchmarks, cleanup, {}, /*needs_engine=*/false};

}  // namespace lwob
