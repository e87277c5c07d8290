#include "bench/common.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace lwob {

namespace {
int g_failures = 0;  // benchmarks that stopped with an error
}  // namespace

void run_guarded(benchmark::State& state, const std::function<void()>& body) {
  std::string message;
  try {
    body();
    return;
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown exception";
  }
  // The console and JSON reporters show the message with the benchmark's name.
  ++g_failures;
  state.SkipWithError(message.c_str());
}

// --- process state ------------------------------------------------------------

namespace {
lwo_engine* g_engine = nullptr;
int g_device = 0;
testkit::Peaks g_peaks;
testkit::LinkRates g_rates;

void report_release(const char* call, const std::string& why) {
  std::fprintf(stderr, "lwo bench: releasing a resource failed: %s: %s\n", call, why.c_str());
}
}  // namespace

const testkit::PeakKnobs kPeakKnobs = [] {
  testkit::PeakKnobs k;
  k.copy_bytes = 256 * MiB;
  k.copies = 4;
  k.warmup = 1;
  k.repeats = 5;
  return k;
}();

lwo_engine* engine() {
  if (!g_engine) fail("no lwo engine in this program");
  return g_engine;
}
int device() { return g_device; }
const testkit::Peaks& peaks() { return g_peaks; }
const testkit::LinkRates& link_rates() { return g_rates; }

// --- flags and main -------------------------------------------------------------

uint64_t parse_uint(const char* flag, const std::string& text, uint64_t min, uint64_t max) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno == ERANGE || v < min || v > max)
    throw std::invalid_argument(strf("%s: '%s' is not a whole number in [%llu, %llu]", flag,
                                     text.c_str(), static_cast<unsigned long long>(min),
                                     static_cast<unsigned long long>(max)));
  return v;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<uint64_t> parse_uint_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max) {
  std::vector<uint64_t> out;
  for (const std::string& item : split_list(text)) out.push_back(parse_uint(flag, item, min, max));
  return out;
}

namespace {

bool flag_is_on(const std::string& arg, const char* name) {
  std::string n = name;
  if (arg == n) return true;
  if (arg.rfind(n + "=", 0) != 0) return false;
  std::string v = arg.substr(n.size() + 1);
  return v != "false" && v != "0" && v != "no";
}

void print_help(const MainSpec& spec) {
  std::printf("%s: %s\n\nflags of this program:\n", spec.program, spec.about);
  for (const Flag& f : spec.flags) std::printf("  %s=...  %s\n", f.name, f.help);
  std::printf(
      "\nand Google Benchmark's own flags, for example:\n"
      "  --benchmark_filter=REGEX --benchmark_list_tests\n"
      "  --benchmark_out=FILE --benchmark_out_format=json\n");
}

}  // namespace

benchmark::internal::Benchmark* timed_ms(benchmark::internal::Benchmark* b, int iterations) {
  return b->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMillisecond);
}

Flag int_flag(const char* name, const char* help, int& target, int min, int max) {
  return {name, help, [name, &target, min, max](const std::string& v) {
            target = static_cast<int>(parse_uint(name, v, static_cast<uint64_t>(min),
                                                 static_cast<uint64_t>(max)));
          }};
}

namespace {

int bench_main(int argc, char** argv) {
  MainSpec spec = kMain;
  int dev = 0;
  spec.flags.insert(spec.flags.begin(),
                    Flag{"--device", "CUDA device ordinal (default 0)", [&](const std::string& v) {
                           dev = static_cast<int>(parse_uint("--device", v, 0, 1023));
                         }});
  // Our own flags first; the rest goes to Google Benchmark.
  std::vector<char*> rest{argv[0]};
  bool listing = false;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        print_help(spec);
        return 0;
      }
      if (flag_is_on(arg, "--benchmark_list_tests")) listing = true;
      const Flag* hit = nullptr;
      std::string value;
      for (const Flag& f : spec.flags) {
        std::string n = f.name;
        if (arg == n) {
          if (i + 1 >= argc) throw std::invalid_argument(n + " needs a value");
          value = argv[++i];
          hit = &f;
        } else if (arg.rfind(n + "=", 0) == 0) {
          value = arg.substr(n.size() + 1);
          hit = &f;
        }
        if (hit) break;
      }
      if (hit)
        hit->set(value);
      else
        rest.push_back(argv[i]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", spec.program, e.what());
    return 2;
  }
  int n_rest = static_cast<int>(rest.size());
  rest.push_back(nullptr);
  benchmark::Initialize(&n_rest, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n_rest, rest.data())) return 2;
  g_device = dev;
  testkit::set_release_reporter(report_release);
  spec.register_benchmarks();

  if (!listing) {
    if (!testkit::no_device_reason().empty()) {
      std::fprintf(stderr, "%s: no CUDA device (%s)\n", spec.program,
                   testkit::no_device_reason().c_str());
      return 1;
    }
    const int n = testkit::device_count();
    if (dev >= n) {
      std::fprintf(stderr, "%s: no CUDA device %d (%d found)\n", spec.program, dev, n);
      return 1;
    }
    try {
      check(cudaSetDevice(dev), "cudaSetDevice");
      cudaDeviceProp prop{};
      check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
      if (spec.needs_engine) {
        lwo_engine_config config = LWO_ENGINE_CONFIG_INIT;
        config.device = dev;
        check(lwo_engine_create(&config, &g_engine), "lwo_engine_create");
      }
      if (spec.needs_peaks) {
        g_peaks = testkit::measure_pinned_peaks(kPeakKnobs, /*h2d_only=*/!spec.needs_d2h_peak);
        g_rates.h2d_gbps = g_peaks.h2d_gbps;
        g_rates.d2h_gbps = g_peaks.d2h_gbps;
        if (spec.needs_d2h_peak) {
          testkit::PeakKnobs both = kPeakKnobs;
          both.direction = testkit::Direction::kBoth;
          const testkit::CopyResult r = testkit::measure_pinned_peak(both);
          g_rates.duplex_h2d_gbps = r.h2d_best_gbps();
          g_rates.duplex_d2h_gbps = r.d2h_best_gbps();
        }
      }
      unsigned v = lwo_version();
      benchmark::AddCustomContext("lwo_version",
                                  strf("%u.%u.%u", v / 10000, v / 100 % 100, v % 100));
      benchmark::AddCustomContext(
          "lwo_device",
          strf("%d: %s (%d SMs, %s, PCI bus %d)", dev, prop.name, prop.multiProcessorCount,
               fmt_bytes(prop.totalGlobalMem).c_str(), prop.pciBusID));
      if (spec.needs_peaks) {
        benchmark::AddCustomContext("lwo_h2d_peak_gbps", strf("%.4f", g_peaks.h2d_gbps));
        if (spec.needs_d2h_peak) {
          benchmark::AddCustomContext("lwo_d2h_peak_gbps", strf("%.4f", g_peaks.d2h_gbps));
          benchmark::AddCustomContext("lwo_duplex_h2d_gbps", strf("%.4f", g_rates.duplex_h2d_gbps));
          benchmark::AddCustomContext("lwo_duplex_d2h_gbps", strf("%.4f", g_rates.duplex_d2h_gbps));
        }
        benchmark::AddCustomContext("lwo_peak_method", kPeakKnobs.method());
      }
      std::fprintf(stderr, "%s: device %d: %s", spec.program, dev, prop.name);
      if (spec.needs_peaks) std::fprintf(stderr, "; pinned peak H2D %.2f GB/s", g_peaks.h2d_gbps);
      if (spec.needs_peaks && spec.needs_d2h_peak)
        std::fprintf(stderr, ", D2H %.2f GB/s, at once %.2f + %.2f GB/s", g_peaks.d2h_gbps,
                     g_rates.duplex_h2d_gbps, g_rates.duplex_d2h_gbps);
      std::fprintf(stderr, "\n");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", spec.program, e.what());
      if (g_engine) testkit::report_release("lwo_engine_destroy", lwo_engine_destroy(g_engine));
      g_engine = nullptr;
      return 1;
    }
  }

  benchmark::RunSpecifiedBenchmarks();
  int rc = 0;
  if (g_failures) {
    std::fprintf(stderr, "%s: %d benchmark%s stopped with an error (see ERROR OCCURRED above)\n",
                 spec.program, g_failures, g_failures == 1 ? "" : "s");
    rc = 1;
  }
  if (spec.cleanup) {
    try {
      spec.cleanup();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: cleanup: %s\n", spec.program, e.what());
      rc = 1;
    }
  }
  if (g_engine) {
    lwo_status_t s = lwo_engine_destroy(g_engine);
    g_engine = nullptr;
    if (s != LWO_OK) {
      std::fprintf(stderr, "%s: lwo_engine_destroy: %s\n", spec.program, lwo_last_error_message());
      rc = 1;
    }
  }
  if (testkit::release_failures()) rc = 1;
  benchmark::Shutdown();
  return rc;
}

}  // namespace
}  // namespace lwob

int main(int argc, char** argv) { return lwob::bench_main(argc, argv); }
