// Shared pieces of the benchmark programs on top of the testkit (checks that
// throw testkit::Error, which each benchmark catches and turns into
// SkipWithError; owners; the peak loop; fills): the pinned copy peaks
// (measured once per process), and one main() for every program (device
// check, engine, peaks, JSON context, Google Benchmark's own flags).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lwo.h"
#include "testkit/check.h"
#include "testkit/copy.h"
#include "testkit/owner.h"
#include "testkit/random.h"
#include "testkit/workload.h"

namespace lwob {

// The shared harness (testkit/): checks that throw testkit::Error,
// owners, the peak loop, the generator and the host fills.
using testkit::check;
using testkit::DeviceMem;
using testkit::device_alloc;
using testkit::elapsed_ms;
using testkit::Error;
using testkit::Event;
using testkit::fail;
using testkit::fmt_bytes;
using testkit::GiB;
using testkit::Grads;
using testkit::KiB;
using testkit::make_event;
using testkit::make_stream;
using testkit::median;
using testkit::MiB;
using testkit::now_seconds;
using testkit::PinnedMem;
using testkit::pinned_alloc;
using testkit::Plan;
using testkit::Pool;
using testkit::Ring;
using testkit::Schedule;
using testkit::Stream;
using testkit::strf;

// Runs `body`; an exception becomes state.SkipWithError(message), so one
// failing configuration does not stop the others (the program then exits 1
// after running the rest).
void run_guarded(benchmark::State& state, const std::function<void()>& body);

// The process's engine (created by bench_main when asked for), and its device.
lwo_engine* engine();
int device();

// Pinned copy peaks in GB/s (1e9 B/s), testkit::measure_pinned_peaks with
// kPeakKnobs: 4 back-to-back copies of 256 MiB between a cudaHostAlloc buffer
// and device memory on one stream, best of 5 rounds after a warm-up round.
// Measured once by bench_main before any benchmark runs (also in the JSON
// context as lwo_h2d_peak_gbps and lwo_d2h_peak_gbps).
extern const testkit::PeakKnobs kPeakKnobs;
const testkit::Peaks& peaks();
// The peaks and both directions at once (with the D2H peak; else the duplex
// rates are 0): the rates of the split floor (testkit::split_floor).
const testkit::LinkRates& link_rates();

// A flag of a program beyond Google Benchmark's own ("--name=VALUE" or
// "--name VALUE").
struct Flag {
  const char* name;
  const char* help;
  std::function<void(const std::string& value)> set;
};
uint64_t parse_uint(const char* flag, const std::string& text, uint64_t min, uint64_t max);
// The comma-separated items of a flag's value, in order (empty ones kept).
std::vector<std::string> split_list(const std::string& text);
std::vector<uint64_t> parse_uint_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max);

// `b` timed by the benchmark itself (manual time), `iterations` times, in ms.
benchmark::internal::Benchmark* timed_ms(benchmark::internal::Benchmark* b, int iterations);

// A flag whose value is a whole number in [min, max], stored into `target`.
Flag int_flag(const char* name, const char* help, int& target, int min, int max);

struct MainSpec {
  const char* program;
  const char* about;                          // one line for --help
  std::function<void()> register_benchmarks;  // after the flags are parsed
  std::function<void()> cleanup;              // before the engine is destroyed
  std::vector<Flag> flags;                    // the program's own flags
  bool needs_engine = true;                   // create the lwo engine on the device
  bool needs_peaks = true;                    // measure the H2D peak
  bool needs_d2h_peak = true;                 // ... and the D2H peak
};

// Each program's, defined in its own file: main() (common.cc) runs it. The
// whole main: flags, registration, then, unless only listing, the device
// check (one line "PROGRAM: no CUDA device ..." and exit 1 without one), the
// engine, the peaks and the run.
extern const MainSpec kMain;

}  // namespace lwob
