#include "bench/common.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

namespace lwob {

std::string strf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&s[0], s.size() + 1, fmt, ap2);
  va_end(ap2);
  return s;
}

std::string fmt_bytes(uint64_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  uint64_t whole = bytes;
  while (u < 4 && whole >= 1024 && whole % 1024 == 0) {
    whole /= 1024;
    ++u;
  }
  if (whole < 1024 || u == 4)
    return strf("%llu %s", static_cast<unsigned long long>(whole), units[u]);
  double v = static_cast<double>(bytes);
  u = 0;
  while (u < 4 && v >= 1024) {
    v /= 1024;
    ++u;
  }
  return strf("%.2f %s", v, units[u]);
}

void fail(const std::string& message) { throw Error(message); }

void check(lwo_status_t status, const char* call) {
  if (status == LWO_OK) return;
  fail(strf("%s: %s: %s", call, lwo_status_string(status), lwo_last_error_message()));
}

void check(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(strf("%s: %s (%s)", call, cudaGetErrorName(error), cudaGetErrorString(error)));
}

void report_release(lwo_status_t status) {
  if (status != LWO_OK)
    std::fprintf(stderr, "lwo bench: releasing a handle failed: %s: %s\n",
                 lwo_status_string(status), lwo_last_error_message());
}

void report_release(cudaError_t error) {
  if (error != cudaSuccess)
    std::fprintf(stderr, "lwo bench: releasing a CUDA resource failed: %s\n",
                 cudaGetErrorString(error));
}

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

Stream make_stream() {
  Stream s;
  check(cudaStreamCreateWithFlags(s.out(), cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

Event make_event() {
  Event e;
  check(cudaEventCreate(e.out()), "cudaEventCreate");
  return e;
}

DeviceMem device_alloc(size_t bytes) {
  DeviceMem m;
  check(cudaMalloc(m.out(), std::max<size_t>(bytes, 1)),
        strf("cudaMalloc(%s)", fmt_bytes(bytes).c_str()).c_str());
  return m;
}

PinnedMem pinned_alloc(size_t bytes) {
  PinnedMem m;
  check(cudaHostAlloc(m.out(), std::max<size_t>(bytes, 1), cudaHostAllocDefault),
        strf("cudaHostAlloc(%s)", fmt_bytes(bytes).c_str()).c_str());
  return m;
}

double elapsed_ms(const Event& a, const Event& b) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a.get(), b.get()), "cudaEventElapsedTime");
  return ms;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// --- process state ------------------------------------------------------------

namespace {
lwo_engine* g_engine = nullptr;
int g_device = 0;
Peaks g_peaks;
}  // namespace

lwo_engine* engine() {
  if (!g_engine) fail("no lwo engine in this program");
  return g_engine;
}
int device() { return g_device; }
const Peaks& peaks() { return g_peaks; }

namespace {

constexpr uint64_t kPeakChunk = 256 * MiB;
constexpr int kPeakChunks = 4;
constexpr int kPeakRounds = 5;

double measure_peak(cudaMemcpyKind kind, void* host, void* dev, cudaStream_t stream, const Event& a,
                    const Event& b) {
  void* dst = kind == cudaMemcpyHostToDevice ? dev : host;
  const void* src = kind == cudaMemcpyHostToDevice ? host : dev;
  double best = std::numeric_limits<double>::infinity();
  for (int round = -1; round < kPeakRounds; ++round) {
    check(cudaEventRecord(a.get(), stream), "cudaEventRecord");
    for (int i = 0; i < kPeakChunks; ++i)
      check(cudaMemcpyAsync(dst, src, kPeakChunk, kind, stream), "cudaMemcpyAsync (peak)");
    check(cudaEventRecord(b.get(), stream), "cudaEventRecord");
    check(cudaEventSynchronize(b.get()), "cudaEventSynchronize");
    if (round >= 0) best = std::min(best, elapsed_ms(a, b));
  }
  return static_cast<double>(kPeakChunk) * kPeakChunks / (best * 1e6);
}

void measure_peaks(bool d2h) {
  PinnedMem host = pinned_alloc(kPeakChunk);
  DeviceMem dev = device_alloc(kPeakChunk);
  std::memset(host.get(), 0x5a, kPeakChunk);
  check(cudaMemset(dev.get(), 0, kPeakChunk), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the memset is not ordered with s
  Stream s = make_stream();
  Event a = make_event(), b = make_event();
  g_peaks.h2d_gbps = measure_peak(cudaMemcpyHostToDevice, host.get(), dev.get(), s.get(), a, b);
  if (d2h)
    g_peaks.d2h_gbps = measure_peak(cudaMemcpyDeviceToHost, host.get(), dev.get(), s.get(), a, b);
}

}  // namespace

// --- host fills -----------------------------------------------------------------

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  size_t n_threads = std::min<size_t>(hw, n);
  if (n_threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  for (size_t t = 0; t < n_threads; ++t)
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) {
        if (failed.load()) return;
        try {
          fn(i);
        } catch (...) {
          if (!failed.exchange(true)) error = std::current_exception();
          return;
        }
      }
    });
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

namespace {
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kFillChunk = uint64_t(1) << 22;  // elements (bytes) per work item

uint16_t f32_to_bf16(float f) {  // round to nearest even; finite inputs
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
}  // namespace

namespace {

// Work items of at most kFillChunk elements over a list of ranges.
struct Item {
  size_t range;
  uint64_t begin, end;
};
template <class R>
std::vector<Item> split(const std::vector<R>& ranges) {
  std::vector<Item> items;
  for (size_t r = 0; r < ranges.size(); ++r)
    for (uint64_t b = 0; b < ranges[r].n; b += kFillChunk)
      items.push_back({r, b, std::min(ranges[r].n, b + kFillChunk)});
  return items;
}

}  // namespace

void fill_random_bytes(const std::vector<ByteRange>& ranges) {
  std::vector<Item> items = split(ranges);
  parallel_for(items.size(), [&](size_t i) {
    const ByteRange& r = ranges[items[i].range];
    auto* p = static_cast<uint8_t*>(r.data);
    // Items start at multiples of 8 bytes: word k holds bytes 8k..8k+7.
    for (uint64_t j = items[i].begin; j < items[i].end; j += 8) {
      uint64_t w = mix64(r.key + (j / 8 + 1) * kGolden);
      std::memcpy(p + j, &w, std::min<uint64_t>(8, items[i].end - j));
    }
  });
}

void fill_uniform_bf16(const std::vector<Bf16Range>& ranges) {
  std::vector<Item> items = split(ranges);
  parallel_for(items.size(), [&](size_t i) {
    const Bf16Range& r = ranges[items[i].range];
    auto* p = static_cast<uint16_t*>(r.data);
    for (uint64_t j = items[i].begin; j < items[i].end; ++j) {
      uint64_t w = mix64(r.key + (j + 1) * kGolden);
      float u = static_cast<float>(w >> 40) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1)
      p[j] = f32_to_bf16(u * r.bound);
    }
  });
}

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

std::vector<uint64_t> parse_uint_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max) {
  std::vector<uint64_t> out;
  size_t start = 0;
  for (;;) {
    size_t comma = text.find(',', start);
    out.push_back(parse_uint(flag, text.substr(start, comma - start), min, max));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
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

int bench_main(int argc, char** argv, const MainSpec& spec_in) {
  MainSpec spec = spec_in;
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
  spec.register_benchmarks();

  if (!listing) {
    int n = 0;
    cudaError_t count_error = cudaGetDeviceCount(&n);
    if (count_error != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "%s: no CUDA device (cudaGetDeviceCount: %s)\n", spec.program,
                   count_error != cudaSuccess ? cudaGetErrorString(count_error) : "0 devices");
      return 1;
    }
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
      if (spec.needs_peaks) measure_peaks(spec.needs_d2h_peak);
      unsigned v = lwo_version();
      benchmark::AddCustomContext("lwo_version",
                                  strf("%u.%u.%u", v / 10000, v / 100 % 100, v % 100));
      benchmark::AddCustomContext(
          "lwo_device",
          strf("%d: %s (%d SMs, %s, PCI bus %d)", dev, prop.name, prop.multiProcessorCount,
               fmt_bytes(prop.totalGlobalMem).c_str(), prop.pciBusID));
      if (spec.needs_peaks) {
        benchmark::AddCustomContext("lwo_h2d_peak_gbps", strf("%.4f", g_peaks.h2d_gbps));
        if (spec.needs_d2h_peak)
          benchmark::AddCustomContext("lwo_d2h_peak_gbps", strf("%.4f", g_peaks.d2h_gbps));
        benchmark::AddCustomContext(
            "lwo_peak_method", strf("pinned (cudaHostAlloc) copies, %d x %s back-to-back on one "
                                    "stream, best of %d rounds",
                                    kPeakChunks, fmt_bytes(kPeakChunk).c_str(), kPeakRounds));
      }
      std::fprintf(stderr, "%s: device %d: %s", spec.program, dev, prop.name);
      if (spec.needs_peaks) std::fprintf(stderr, "; pinned peak H2D %.2f GB/s", g_peaks.h2d_gbps);
      if (spec.needs_peaks && spec.needs_d2h_peak)
        std::fprintf(stderr, ", D2H %.2f GB/s", g_peaks.d2h_gbps);
      std::fprintf(stderr, "\n");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", spec.program, e.what());
      if (g_engine) lwo_engine_destroy(g_engine);
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
  benchmark::Shutdown();
  return rc;
}

}  // namespace lwob
