// Shared pieces of the benchmark programs: error checks that throw (each
// benchmark catches and turns them into SkipWithError), owners of lwo handles
// and CUDA resources, the pinned copy peaks (measured once per process), host
// fills from all cores, and one main() for every program (device check,
// engine, peaks, JSON context, Google Benchmark's own flags).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lwo.h"

namespace lwob {

constexpr uint64_t KiB = 1024, MiB = KiB << 10, GiB = MiB << 10;

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string fmt_bytes(uint64_t bytes);  // "256 KiB", "1.50 GiB"

// A failed call inside a benchmark: caught by run_guarded, reported with
// state.SkipWithError.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string& message);
void check(lwo_status_t status, const char* call);
void check(cudaError_t error, const char* call);
#define LWOB_CHECK(call) ::lwob::check((call), #call)

// Runs `body`; an exception becomes state.SkipWithError(message), so one
// failing configuration does not stop the others (the program then exits 1
// after running the rest).
void run_guarded(benchmark::State& state, const std::function<void()>& body);

// Owns one handle, released by `Free` (errors go to stderr, never thrown).
template <class T, class R, R (*Free)(T)>
class Owner {
 public:
  Owner() = default;
  explicit Owner(T p) : p_(p) {}
  Owner(Owner&& o) noexcept : p_(std::exchange(o.p_, T{})) {}
  Owner& operator=(Owner&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, T{});
    }
    return *this;
  }
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  ~Owner() { reset(); }
  T get() const { return p_; }
  T* out() {
    reset();
    return &p_;
  }
  void reset() noexcept {
    if (p_) report(Free(std::exchange(p_, T{})));
  }

 private:
  static void report(R status);
  T p_{};
};
void report_release(lwo_status_t status);
void report_release(cudaError_t error);
template <class T, class R, R (*Free)(T)>
void Owner<T, R, Free>::report(R status) {
  report_release(status);
}

using Pool = Owner<lwo_pool*, lwo_status_t, lwo_pool_destroy>;
using Ring = Owner<lwo_ring*, lwo_status_t, lwo_ring_destroy>;
using Schedule = Owner<lwo_schedule*, lwo_status_t, lwo_schedule_destroy>;
using Grads = Owner<lwo_grads*, lwo_status_t, lwo_grads_destroy>;
using Stream = Owner<cudaStream_t, cudaError_t, cudaStreamDestroy>;
using Event = Owner<cudaEvent_t, cudaError_t, cudaEventDestroy>;
using DeviceMem = Owner<void*, cudaError_t, cudaFree>;
using PinnedMem = Owner<void*, cudaError_t, cudaFreeHost>;

Stream make_stream();  // non-blocking
Event make_event();    // with timing
DeviceMem device_alloc(size_t bytes);
PinnedMem pinned_alloc(size_t bytes);
double elapsed_ms(const Event& a, const Event& b);  // both completed

double now_seconds();  // steady clock
double median(std::vector<double> v);

// The process's engine (created by bench_main when asked for), and its device.
lwo_engine* engine();
int device();

// Pinned copy peaks in GB/s (1e9 B/s): 4 back-to-back copies of 256 MiB
// between a cudaHostAlloc buffer and device memory on one stream, best of 5
// rounds after a warm-up round. Measured once by bench_main before any
// benchmark runs (also in the JSON context as lwo_h2d_peak_gbps and
// lwo_d2h_peak_gbps).
struct Peaks {
  double h2d_gbps = 0, d2h_gbps = 0;
};
const Peaks& peaks();

// Calls fn(i) for i in [0, n) from all cores.
void parallel_for(size_t n, const std::function<void(size_t)>& fn);
// Pseudo-random bytes in each range, depending only on its key and the
// position; from all cores.
struct ByteRange {
  void* data;
  uint64_t n;  // bytes
  uint64_t key;
};
void fill_random_bytes(const std::vector<ByteRange>& ranges);
// bf16 values uniform in [-bound, bound), depending only on the key and the
// position; from all cores.
struct Bf16Range {
  void* data;
  uint64_t n;  // elements
  float bound;
  uint64_t key;
};
void fill_uniform_bf16(const std::vector<Bf16Range>& ranges);
uint64_t mix64(uint64_t z);

// A flag of a program beyond Google Benchmark's own ("--name=VALUE" or
// "--name VALUE").
struct Flag {
  const char* name;
  const char* help;
  std::function<void(const std::string& value)> set;
};
uint64_t parse_uint(const char* flag, const std::string& text, uint64_t min, uint64_t max);
std::vector<uint64_t> parse_uint_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max);

struct MainSpec {
  const char* program;
  const char* about;                          // one line for --help
  std::vector<Flag> flags;                    // the program's own flags
  bool needs_engine = true;                   // create the lwo engine on the device
  bool needs_peaks = true;                    // measure the H2D peak
  bool needs_d2h_peak = true;                 // ... and the D2H peak
  std::function<void()> register_benchmarks;  // after the flags are parsed
  std::function<void()> cleanup;              // before the engine is destroyed
};

// The whole main(): flags, registration, then, unless only listing, the
// device check (one line "PROGRAM: no CUDA device ..." and exit 1 without
// one), the engine, the peaks and the run.
int bench_main(int argc, char** argv, const MainSpec& spec);

}  // namespace lwob
