// The host optimizer against the host's memory bandwidth, in one run: a
// multithreaded copy and triad loop on the optimizer's own threads
// (optim::Workers, the same fixed parts) measure the bandwidth; AdamW with
// f32 and bf16 state (and SGD) on 2^28 parameters report parameters per
// second, the bytes each parameter must move, the floor those give at the
// triad bandwidth measured beside the steps (one triad pass before each
// timed step, the median of those: a shared host's bandwidth drifts by tens
// of percent within a minute), and the ratio to it (target: at least 0.85).
// A last case alternates AdamW steps that write the bf16 weights with steps
// that write the fused fp8 block-128 copy instead, on one tensor, and reports
// the ratio of their times. Host only: it needs no GPU.
//
//   build/bench/bench_optim [--params_log2=28] [--threads=0] [--min_time=2]
//                           [--benchmark_filter=...] [--benchmark_format=json]
//
// Bytes per parameter (testkit::update_bytes_per_param), as memory traffic with write-allocate (an array only
// written with plain stores is read first as well; one read and written in
// place is not; the pool's weights are written with streaming stores where
// the host has AVX2 or AVX-512, which read nothing): AdamW f32 state 28 (p,
// m, v read and written: 24; g 2; w 2), bf16 state 20 (p 8; m, v 8; g 2; w
// 2); SGD f32 momentum 20 (p 8, b 8, g 2, w 2); on a host without them, 2
// more each (w read for ownership). Counted alike, the triad a[i] = b[i] +
// s c[i] moves 16 bytes per element (b, c, a read for ownership, a written)
// and the copy 12: the floor is the triad's bandwidth over the parameter's
// bytes.
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
#include "testkit/dtype.h"
#include "src/optim/workers.h"

namespace {

using lwo::optim::Workers;

uint32_t g_log2 = 28;
uint32_t g_threads = 0;
double g_min_time = 2.0;

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

// The triad's arrays: 2^log2 floats each, first touched by the workers.
struct TriadArrays {
  uint64_t n;
  Mapping A, B, C;
  explicit TriadArrays(uint64_t n_) : n(n_), A(n * 4), B(n * 4), C(n * 4) {
    float *a = A.as<float>(), *b = B.as<float>(), *c = C.as<float>();
    workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart, [&](uint64_t lo, uint64_t hi) {
      for (uint64_t i = lo; i < hi; ++i) {
        a[i] = 0;
        b[i] = 1.0f + static_cast<float>(i & 7);
        c[i] = 0.5f;
      }
    });
  }
  // One triad pass: its bandwidth (16 bytes per element).
  double triad_gbps() {
    float *a = A.as<float>(), *b = B.as<float>(), *c = C.as<float>();
    auto t0 = std::chrono::steady_clock::now();
    workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart,
                  [&](uint64_t lo, uint64_t hi) { triad_range(a, b, c, 0.5f, lo, hi); });
    return 16.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
  }
  double copy_gbps() {
    float *a = A.as<float>(), *b = B.as<float>();
    auto t0 = std::chrono::steady_clock::now();
    workers().run(n, lwo::optim::kAlign, lwo::optim::kMinPart,
                  [&](uint64_t lo, uint64_t hi) { copy_range(a, b, lo, hi); });
    return 12.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
  }
};

TriadArrays& triad_arrays() {
  static TriadArrays t(uint64_t(1) << g_log2);
  return t;
}

// The host bandwidth, once per process: the best of 5 passes of each loop
// over 2^log2 floats per array.
const Bandwidth& bandwidth() {
  static Bandwidth bw = [] {
    Bandwidth r;
    for (int rep = 0; rep < 5; ++rep) {
      r.copy_gbps = std::max(r.copy_gbps, triad_arrays().copy_gbps());
      r.triad_gbps = std::max(r.triad_gbps, triad_arrays().triad_gbps());
    }
    return r;
  }();
  return bw;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// paired_gbps: the triad passes run one before each timed step (the
// host's bandwidth drifts on a shared machine: the floor that counts is the
// one measured beside the step).
void report(benchmark::State& st, uint64_t n, double bytes_per_param,
            const std::vector<double>& paired_gbps) {
  const Bandwidth& bw = bandwidth();
  const double paired = median_of(paired_gbps);
  st.counters["params_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bytes_per_param"] = bytes_per_param;
  st.counters["triad_GBps"] = bw.triad_gbps;
  st.counters["copy_GBps"] = bw.copy_gbps;
  st.counters["paired_triad_GBps"] = paired;
  st.counters["floor_params_per_s"] = paired * 1e9 / bytes_per_param;
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
  std::vector<double> paired;
  for (auto _ : st) {
    paired.push_back(triad_arrays().triad_gbps());
    const auto t0 = std::chrono::steady_clock::now();
    if (kind == 0)
      lwo::optim::adamw_step(t, lwo::optim::AdamW{}, step++, workers());
    else
      lwo::optim::sgd_step(t, lwo::optim::Sgd{}, step++, workers());
    st.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  report(st, n,
         testkit::update_bytes_per_param(kind == 0, sd, LWO_DTYPE_BF16, LWO_DTYPE_BF16,
                                         lwo::optim::vector_level()),
         paired);
}

// AdamW with f32 state on one 2^log2-parameter tensor (2^(log2 - 12) x
// 4096), its steps alternating between the bf16 weights' write (the pool's
// dtype; AdamW/f32_state's step) and the fused fp8 block-128 write
// (Tensor::quant_format: the codes and scales, no bf16 weights), each timed
// on its own: the ratio of their medians is the fused write's cost over the
// update alone (target: at most 1.05). Alternating pairs cancel a shared
// host's drift.
void BM_Fp8Write(benchmark::State& st) {
  bandwidth();
  const uint64_t n = uint64_t(1) << g_log2, cols = 4096, rows = n / cols;
  Mapping P(n * 4), M(n * 4), V(n * 4), G(n * 2), W(n * 2), Q(n), S(4 * (rows / 128) * (cols / 128) + 4096);
  void* state[2] = {M.p, V.p};
  lwo::optim::first_touch(P.as<float>(), nullptr, LWO_DTYPE_F32, n, state, 2, LWO_DTYPE_F32, workers());
  workers().run(n, 128 * cols, lwo::optim::kMinPart, [&](uint64_t lo, uint64_t hi) {
    uint16_t* g = G.as<uint16_t>();
    for (uint64_t i = lo; i < hi; ++i) {
      g[i] = lwo::f32_to_bf16(static_cast<float>(static_cast<int>(i % 201) - 100) * 1e-3f);
      W.as<uint16_t>()[i] = 0;
      Q.as<uint8_t>()[i] = 0;
    }
  });
  lwo::optim::Tensor bf16;
  bf16.n = n;
  bf16.master = P.as<float>();
  bf16.m = M.p;
  bf16.v = V.p;
  bf16.state_dtype = LWO_DTYPE_F32;
  bf16.grad = G.p;
  bf16.grad_dtype = LWO_DTYPE_BF16;
  bf16.weights = W.p;
  bf16.weight_dtype = LWO_DTYPE_BF16;
  lwo::optim::Tensor fp8 = bf16;
  fp8.weights = nullptr;
  fp8.quant_format = LWO_QUANT_FP8_E4M3_BLOCK128;
  fp8.rows = static_cast<int64_t>(rows);
  fp8.cols = static_cast<int64_t>(cols);
  fp8.codes = Q.as<uint8_t>();
  fp8.scales = S.as<float>();
  uint64_t step = 1;
  std::vector<double> t_bf16, t_fp8;
  auto timed = [&](const lwo::optim::Tensor& t) {
    const auto t0 = std::chrono::steady_clock::now();
    lwo::optim::adamw_step(t, lwo::optim::AdamW{}, step++, workers());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : st) {
    t_bf16.push_back(timed(bf16));
    t_fp8.push_back(timed(fp8));
    st.SetIterationTime(t_bf16.back() + t_fp8.back());
  }
  const double a = median_of(t_bf16), b = median_of(t_fp8);
  st.counters["bf16_write_ms"] = a * 1e3;
  st.counters["fp8_block_write_ms"] = b * 1e3;
  st.counters["bf16_params_per_s"] = n / a;
  st.counters["fp8_params_per_s"] = n / b;
  st.counters["fp8_over_bf16"] = b / a;
  st.counters["threads"] = workers().size();
  st.SetLabel(lwo::optim::vector_level());
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
    else if (a.rfind("--min_time=", 0) == 0)
      g_min_time = std::atof(a.c_str() + 11);
    else
      args.push_back(argv[i]);
  }
  if (!(g_min_time > 0 && g_min_time <= 600)) {
    std::fprintf(stderr, "bench_optim: --min_time=%g is outside (0, 600] seconds\n", g_min_time);
    return 2;
  }
  if (g_log2 < 16 || g_log2 > 33) {
    std::fprintf(stderr, "bench_optim: --params_log2=%u is outside 16..33\n", g_log2);
    return 2;
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  benchmark::RegisterBenchmark("HostBandwidth", BM_HostBandwidth)->Iterations(1)->UseRealTime();
  benchmark::RegisterBenchmark("AdamW/f32_state", BM_Optimizer, 0, LWO_DTYPE_F32, false)
      ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(g_min_time);
  benchmark::RegisterBenchmark("AdamW/bf16_state", BM_Optimizer, 0, LWO_DTYPE_BF16, false)
      ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(g_min_time);
  benchmark::RegisterBenchmark("AdamW/bf16_state_stochastic", BM_Optimizer, 0, LWO_DTYPE_BF16, true)
      ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(g_min_time);
  benchmark::RegisterBenchmark("SGD/f32_momentum", BM_Optimizer, 1, LWO_DTYPE_F32, false)
      ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(g_min_time);
  if (g_log2 >= 19)  // at least one band of 128 x 4096
    benchmark::RegisterBenchmark("AdamW/f32_state/bf16_write_vs_fp8_block_write", BM_Fp8Write)
        ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(g_min_time);
  // Each optimizer run's ratio to the floor, in one line per run at the end.
  struct Ratio : benchmark::ConsoleReporter {
    std::vector<std::string> lines;
    void ReportRuns(const std::vector<Run>& runs) override {
      ConsoleReporter::ReportRuns(runs);
      for (const Run& r : runs) {
        auto q = r.counters.find("fp8_over_bf16");
        if (q != r.counters.end() && r.run_type == Run::RT_Iteration) {
          char qb[320];
          std::snprintf(qb, sizeof qb,
                        "%-32s adamw bf16 write %.3f G params/s, adamw + fp8-block write %.3f G "
                        "params/s: fused / update alone %.3fx (target 1.05x)",
                        r.benchmark_name().c_str(), r.counters.at("bf16_params_per_s").value / 1e9,
                        r.counters.at("fp8_params_per_s").value / 1e9, q->second.value);
          lines.push_back(qb);
          continue;
        }
        auto p = r.counters.find("params_per_s"), f = r.counters.find("floor_params_per_s");
        if (p == r.counters.end() || f == r.counters.end() || r.run_type != Run::RT_Iteration) continue;
        auto tr = r.counters.find("paired_triad_GBps"), b = r.counters.find("bytes_per_param");
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "%-32s %.3f G params/s, floor %.3f G params/s (triad beside the steps %.1f GB/s, "
                      "%.0f B/param): %.1f%% of the floor (target 85%%)",
                      r.benchmark_name().c_str(), p->second.value / 1e9, f->second.value / 1e9,
                      tr == r.counters.end() ? 0.0 : tr->second.value,
                      b == r.counters.end() ? 0.0 : b->second.value,
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
