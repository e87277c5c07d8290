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
enum class Direction { kH2D, kD2H, kBoth };

const char* memory_name(Memory m) {
  switch (m) {
    case Memory::kPinned:
      return "pinned";
    case Memory::kRegistered:
      return "registered";
    default:
      return "pageable";
  }
}
const char* direction_name(Direction d) {
  switch (d) {
    case Direction::kH2D:
      return "h2d";
    case Direction::kD2H:
      return "d2h";
    default:
      return "both";
  }
}

// Two host buffers of kMaxBytes of one kind (the H2D source and the D2H
// destination), touched before use so no page fault is timed.
class HostBuffers {
 public:
  explicit HostBuffers(Memory kind) : kind_(kind) {
    try {
      allocate();
    } catch (...) {
      release();
      throw;
    }
  }
  ~HostBuffers() { release(); }
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;
  Memory kind() const { return kind_; }
  void* src() const { return p_[0]; }
  void* dst() const { return p_[1]; }

 private:
  void allocate() {
    const Memory kind = kind_;
    for (void*& p : p_) {
      if (kind == Memory::kPinned) {
        check(cudaHostAlloc(&p, kMaxBytes, cudaHostAllocDefault), "cudaHostAlloc");
      } else {
        if (posix_memalign(&p, 4096, kMaxBytes) != 0) {
          p = nullptr;
          fail(strf("posix_memalign(%s) failed", fmt_bytes(kMaxBytes).c_str()));
        }
        if (kind == Memory::kRegistered) (void)madvise(p, kMaxBytes, MADV_HUGEPAGE);
      }
      std::memset(p, 0x5a, kMaxBytes);
      if (kind == Memory::kRegistered) {
        check(cudaHostRegister(p, kMaxBytes, cudaHostRegisterDefault), "cudaHostRegister");
        registered_[&p - p_] = true;
      }
    }
  }
  void release() noexcept {
    for (void*& p : p_) {
      if (!p) continue;
      if (kind_ == Memory::kPinned) {
        report_release(cudaFreeHost(p));
      } else {
        if (kind_ == Memory::kRegistered && registered_[&p - p_])
          report_release(cudaHostUnregister(p));
        std::free(p);
      }
      p = nullptr;
    }
  }

  Memory kind_;
  bool registered_[2] = {false, false};
  void* p_[2] = {nullptr, nullptr};
};

// Resources kept across benchmarks (registered memory-kind-major, so one kind
// of host buffers at a time); freed by cleanup().
struct Shared {
  std::unique_ptr<HostBuffers> host;
  DeviceMem dev[2];
  Stream stream[2];
  Event start, end[2];
  bool ready = false;
};
Shared* g_shared = nullptr;

Shared& shared(Memory kind) {
  if (!g_shared) g_shared = new Shared;
  Shared& s = *g_shared;
  if (!s.ready) {
    s.dev[0] = device_alloc(kMaxBytes);
    s.dev[1] = device_alloc(kMaxBytes);
    check(cudaMemset(s.dev[0].get(), 0, kMaxBytes), "cudaMemset");
    check(cudaMemset(s.dev[1].get(), 0, kMaxBytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // not ordered with our streams
    s.stream[0] = make_stream();
    s.stream[1] = make_stream();
    s.start = make_event();
    s.end[0] = make_event();
    s.end[1] = make_event();
    s.ready = true;
  }
  if (!s.host || s.host->kind() != kind) {
    s.host.reset();  // free the other kind first
    s.host = std::make_unique<HostBuffers>(kind);
  }
  return s;
}

void cleanup() {
  delete g_shared;
  g_shared = nullptr;
}

struct BatchTimes {
  double all_ms = 0, h2d_ms = 0, d2h_ms = 0;
};

// One batch: `copies` copies of `bytes` per direction. For both directions the
// copies are enqueued alternately (H2D on stream 0, D2H on stream 1), so that
// pageable copies, which hold the host thread, still overlap.
BatchTimes run_batch(Shared& s, Direction dir, uint64_t bytes, uint64_t copies) {
  cudaStream_t s0 = s.stream[0].get(), s1 = s.stream[1].get();
  check(cudaEventRecord(s.start.get(), s0), "cudaEventRecord");
  if (dir == Direction::kBoth)
    check(cudaStreamWaitEvent(s1, s.start.get(), 0), "cudaStreamWaitEvent");
  for (uint64_t i = 0; i < copies; ++i) {
    if (dir != Direction::kD2H)
      check(cudaMemcpyAsync(s.dev[0].get(), s.host->src(), bytes, cudaMemcpyHostToDevice, s0),
            "cudaMemcpyAsync (H2D)");
    if (dir != Direction::kH2D)
      check(cudaMemcpyAsync(s.host->dst(), s.dev[1].get(), bytes, cudaMemcpyDeviceToHost,
                            dir == Direction::kBoth ? s1 : s0),
            "cudaMemcpyAsync (D2H)");
  }
  check(cudaEventRecord(s.end[0].get(), s0), "cudaEventRecord");
  if (dir == Direction::kBoth) check(cudaEventRecord(s.end[1].get(), s1), "cudaEventRecord");
  check(cudaEventSynchronize(s.end[0].get()), "cudaEventSynchronize");
  BatchTimes t;
  if (dir == Direction::kBoth) {
    check(cudaEventSynchronize(s.end[1].get()), "cudaEventSynchronize");
    t.h2d_ms = elapsed_ms(s.start, s.end[0]);
    t.d2h_ms = elapsed_ms(s.start, s.end[1]);
    t.all_ms = std::max(t.h2d_ms, t.d2h_ms);
  } else {
    t.all_ms = elapsed_ms(s.start, s.end[0]);
    (dir == Direction::kH2D ? t.h2d_ms : t.d2h_ms) = t.all_ms;
  }
  return t;
}

void bm_copy(benchmark::State& state, Memory kind, Direction dir) {
  run_guarded(state, [&] {
    const uint64_t bytes = static_cast<uint64_t>(state.range(0));
    const uint64_t copies = std::max<uint64_t>(1, kBatchBytes / bytes);
    const uint64_t moved = bytes * copies * (dir == Direction::kBoth ? 2 : 1);
    Shared& s = shared(kind);
    run_batch(s, dir, bytes, copies);  // warm-up
    std::vector<double> all, h2d, d2h;
    for (auto _ : state) {
      BatchTimes t = run_batch(s, dir, bytes, copies);
      state.SetIterationTime(t.all_ms / 1e3);
      all.push_back(t.all_ms);
      h2d.push_back(t.h2d_ms);
      d2h.push_back(t.d2h_ms);
    }
    auto gbps = [](uint64_t b, double ms) {
      return ms > 0 ? static_cast<double>(b) / (ms * 1e6) : 0.0;
    };
    const double med = gbps(moved, median(all));
    state.counters["GB/s"] = med;
    state.counters["GB/s_best"] = gbps(moved, *std::min_element(all.begin(), all.end()));
    state.counters["share_of_peak"] = peaks().h2d_gbps > 0 ? med / peaks().h2d_gbps : 0;
    state.counters["bytes"] = static_cast<double>(bytes);
    state.counters["copies_per_batch"] = static_cast<double>(copies);
    if (dir == Direction::kBoth) {
      state.counters["h2d_GB/s"] = gbps(bytes * copies, median(h2d));
      state.counters["d2h_GB/s"] = gbps(bytes * copies, median(d2h));
    }
    state.SetBytesProcessed(static_cast<int64_t>(moved) * state.iterations());
  });
}

void register_benchmarks() {
  for (Memory m : {Memory::kPinned, Memory::kRegistered, Memory::kPageable})
    for (Direction d : {Direction::kH2D, Direction::kD2H, Direction::kBoth}) {
      std::string name = strf("copy/%s/%s", memory_name(m), direction_name(d));
      auto* b = benchmark::RegisterBenchmark(name.c_str(),
                                             [m, d](benchmark::State& st) { bm_copy(st, m, d); });
      for (uint64_t bytes = 256 * KiB; bytes <= kMaxBytes; bytes *= 4)
        b->Arg(static_cast<int64_t>(bytes));
      b->ArgName("bytes")->UseManualTime()->Iterations(kIterations)->Unit(benchmark::kMillisecond);
    }
}

}  // namespace
}  // namespace lwob

int main(int argc, char** argv) {
  lwob::MainSpec spec;
  spec.program = "bench_copy";
  spec.about = "host<->device copy bandwidth by size: pinned, registered, pageable; H2D, D2H, both";
  spec.needs_engine = false;
  spec.register_benchmarks = lwob::register_benchmarks;
  spec.cleanup = lwob::cleanup;
  return lwob::bench_main(argc, argv, spec);
}
