// The host optimizer against the host's memory bandwidth, in one run (issue
// 17): a multithreaded copy and triad loop on the optimizer's own threads
// (optim::Workers, the same fixed parts) measure the bandwidth once per
// process; AdamW with f32 and bf16 state (and SGD) on 2^28 parameters
// report parameters per second, the bytes each parameter must move, the
// floor those give at the measured triad bandwidth, and the ratio to it
// (target: at least 0.85). Host only: it needs no GPU.
//
//   build/bench/bench_optim [--params_log2=28] [--threads=0] [--benchmark_format=json]
//
// Bytes per parameter, as memory traffic with write-allocate (an array only
// written is read first as well; one read and written in place is not):
// AdamW f32 state 30 (p, m, v read and written: 24; g 2; w written 4), bf16
// state 22 (p 8; m, v 8; g 2; w 4); SGD f32 momentum 22 (p 8, b 8, g 2, w
// 4). Counted alike, the triad a[i] = b[i] + s c[i] moves 16 bytes per
// element (b, c, a read for ownership, a written) and the copy 12: the floor
// is the triad's bandwidth over the parameter's bytes.
#include <benchmark/benchmark.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/optim/optim.h"
#include "src/optim/workers.h"

namespace {

using lwo::optim::Workers;

uint32_t g_log2 = 28;
uint32_t g_threads = 0;

Workers& workers() {
  static Workers w(g_threads);
  return w;
}

// Untouched memory (first touched by the workers' own parts).
struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  // As the optimizer maps its state (optim::map_state).
  explicit Mapping(size_t b) : bytes(b) {
    try {
      p = lwo::optim::map_state(b, "bench_optim");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::exit(1);
    }
  }
  ~Mapping() { lwo::optim::unmap_state(p, bytes); }
  template <class T>
  T* as() { return static_cast<T*>(p); }
};

LWO_VECTOR_LOOP void triad_range(float* __restrict a, const float* __restrict b,
                                 const float* __restrict c, float s, uint64_t lo, uint64_t hi) {
  for (uint64_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}
LWO_VECTOR_LOOP void copy_range(float* __restrict a, const float* __restrict b, uint64_t lo,
                                uint64_t hi) {
  for (uint64_t i = lo; i < hi; ++i) a[i] = b[i];
}

struct Bandwidth {
  double copy_gbps = 0, triad_gbps = 0;
};

// The host bandwidth, once per process: the best of 5 passes of each loop
// over 2^log2 floats per array.
const Bandwidth& bandwidth() {
  static Bandwidth bw = [] {
    const uint64_t n = uint64_t(1) << g_log2;
    Mapping A(n * 4), B(n * 4), C(n * 4);
    float *a = A.as<float>(), *b = B.as<float>(), *c = C.as<float>();
    workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart, [&](uint64_t lo, uint64_t hi) {
      for (uint64_t i = lo; i < hi; ++i) {
        a[i] = 0;
        b[i] = 1.0f + static_cast<float>(i & 7);
        c[i] = 0.5f;
      }
    });
    Bandwidth r;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart,
                    [&](uint64_t lo, uint64_t hi) { copy_range(a, b, lo, hi); });
      auto t1 = std::chrono::steady_clock::now();
      workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart,
                    [&](uint64_t lo, uint64_t hi) { triad_range(a, b, c, 0.5f, lo, hi); });
      auto t2 = std::chrono::steady_clock::now();
      r.copy_gbps = std::max(r.copy_gbps, 12.0 * n / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      r.triad_gbps = std::max(r.triad_gbps, 16.0 * n / std::chrono::duration<double>(t2 - t1).count() / 1e9);
    }
    return r;
  }();
  return bw;
}

void report(benchmark::State& st, uint64_t n, double bytes_per_param) {
  const Bandwidth& bw = bandwidth();
  st.counters["params_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bytes_per_param"] = bytes_per_param;
  st.counters["triad_GBps"] = bw.triad_gbps;
  st.counters["copy_GBps"] = bw.copy_gbps;
  st.counters["floor_params_per_s"] = bw.triad_gbps * 1e9 / bytes_per_param;
  st.counters["threads"] = workers().size();
  st.SetLabel(lwo::optim::vector_level());
}

void BM_HostBandwidth(benchmark::State& st) {
  for (auto _ : st) benchmark::DoNotOptimize(bandwidth().triad_gbps);
  st.counters["triad_GBps"] = bandwidth().triad_gbps;
  st.counters["copy_GBps"] = bandwidth().copy_gbps;
  st.counters["threads"] = workers().size();
}

// kind 0: AdamW, 1: SGD; state f32 or bf16 (stochastic when sr).
void BM_Optimizer(benchmark::State& st, int kind, lwo_dtype_t sd, bool sr) {
  bandwidth();  // first, outside the timing
  const uint64_t n = uint64_t(1) << g_log2;
  const size_t ss = lwo_dtype_size(sd);
  Mapping P(n * 4), M(n * ss), V(kind == 0 ? n * ss : 4096), G(n * 2), W(n * 2);
  void* state[2] = {M.p, kind == 0 ? V.p : nullptr};
  // Masters from zero weights (first touch by the workers), gradients a
  // spread of values.
  lwo::optim::first_touch(P.as<float>(), nullptr, LWO_DTYPE_F32, n, state, kind == 0 ? 2 : 1, sd,
                          workers());
  workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart, [&](uint64_t lo, uint64_t hi) {
    uint16_t* g = G.as<uint16_t>();
    uint16_t* w = W.as<uint16_t>();
    for (uint64_t i = lo; i < hi; ++i) {
      g[i] = lwo::f32_to_bf16(static_cast<float>(static_cast<int>(i % 201) - 100) * 1e-3f);
      w[i] = 0;
    }
  });
  lwo::optim::Tensor t;
  t.n = n;
  t.master = P.as<float>();
  t.m = M.p;
  t.v = kind == 0 ? V.p : nullptr;
  t.state_dtype = sd;
  t.stochastic = sr;
  t.key = 7;
  t.grad = G.p;
  t.grad_dtype = LWO_DTYPE_BF16;
  t.weights = W.p;
  t.weight_dtype = LWO_DTYPE_BF16;
  uint64_t step = 1;
  for (auto _ : st) {
    if (kind == 0)
      lwo::optim::adamw_step(t, lwo::optim::AdamW{}, step++, workers());
    else
      lwo::optim::sgd_step(t, lwo::optim::Sgd{}, step++, workers());
  }
  const double bytes = kind == 0 ? (sd == LWO_DTYPE_F32 ? 30.0 : 22.0) : 22.0;
  report(st, n, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--params_log2=", 0) == 0)
      g_log2 = static_cast<uint32_t>(std::atoi(a.c_str() + 14));
    else if (a.rfind("--threads=", 0) == 0)
      g_threads = static_cast<uint32_t>(std::atoi(a.c_str() + 10));
    else
      args.push_back(argv[i]);
  }
  if (g_log2 < 16 || g_log2 > 33) {
    std::fprintf(stderr, "bench_optim: --params_log2=%u is outside 16..33\n", g_log2);
    return 2;
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  benchmark::RegisterBenchmark("HostBandwidth", BM_HostBandwidth)->Iterations(1)->UseRealTime();
  benchmark::RegisterBenchmark("AdamW/f32_state", BM_Optimizer, 0, LWO_DTYPE_F32, false)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
  benchmark::RegisterBenchmark("AdamW/bf16_state", BM_Optimizer, 0, LWO_DTYPE_BF16, false)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
  benchmark::RegisterBenchmark("AdamW/bf16_state_stochastic", BM_Optimizer, 0, LWO_DTYPE_BF16, true)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
  benchmark::RegisterBenchmark("SGD/f32_momentum", BM_Optimizer, 1, LWO_DTYPE_F32, false)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
  // Each optimizer run's ratio to the floor, in one line per run at the end.
  struct Ratio : benchmark::ConsoleReporter {
    std::vector<std::string> lines;
    void ReportRuns(const std::vector<Run>& runs) override {
      ConsoleReporter::ReportRuns(runs);
      for (const Run& r : runs) {
        auto p = r.counters.find("params_per_s"), f = r.counters.find("floor_params_per_s");
        if (p == r.counters.end() || f == r.counters.end() || r.run_type != Run::RT_Iteration) continue;
        char buf[256];
        std::snprintf(buf, sizeof buf, "%-32s %.3f G params/s, floor %.3f G params/s: %.1f%% of the floor (target 85%%)",
                      r.benchmark_name().c_str(), p->second.value / 1e9, f->second.value / 1e9,
                      100.0 * p->second.value / f->second.value);
        lines.push_back(buf);
      }
    }
    void Finalize() override {
      ConsoleReporter::Finalize();
      for (auto& l : lines) std::printf("%s\n", l.c_str());
    }
  } reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
