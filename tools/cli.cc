#include "tools/cli.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>

#include "testkit/checksum.h"

namespace cli {

bool g_cleanup_failed = false;
bool g_quiet = false;

std::string strf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(s.data(), s.size() + 1, fmt, ap2);
  va_end(ap2);
  return s;
}

void fail(const std::string& message) {
  std::fprintf(stderr, "lwo: %s\n", message.c_str());
  throw Failure(message);
}

void check(lwo_status_t status, const char* call) {
  if (status == LWO_OK) return;
  fail(strf("%s failed: %s: %s", call, lwo_status_string(status), lwo_last_error_message()));
}

void check(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(strf("%s failed: %s: %s", call, cudaGetErrorName(error), cudaGetErrorString(error)));
}

void report_cleanup(lwo_status_t status, const char* call) {
  std::fprintf(stderr, "lwo: %s failed: %s: %s\n", call, lwo_status_string(status),
               lwo_last_error_message());
  g_cleanup_failed = true;
}

void report_cleanup(cudaError_t error, const char* call) {
  std::fprintf(stderr, "lwo: %s failed: %s: %s\n", call, cudaGetErrorName(error),
               cudaGetErrorString(error));
  g_cleanup_failed = true;
}

Stream make_stream() {
  cudaStream_t s = nullptr;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s);
}

Event make_event() {
  cudaEvent_t e = nullptr;
  CHECK(cudaEventCreate(&e));
  return Event(e);
}

DeviceMem device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), strf("cudaMalloc(%zu bytes)", bytes).c_str());
  return DeviceMem(p);
}

float elapsed_ms(const Event& a, const Event& b) {
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return ms;
}

void open_device(int ordinal, Device& device) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    fail(strf("no CUDA device was found (cudaGetDeviceCount: %s)",
              e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
  }
  if (ordinal >= n)
    fail(strf("CUDA device %d does not exist (%d device%s found)", ordinal, n, n == 1 ? "" : "s"));
  device.ordinal = ordinal;
  CHECK(cudaSetDevice(ordinal));
  CHECK(cudaGetDeviceProperties(&device.prop, ordinal));
  lwo_engine_config config = LWO_ENGINE_CONFIG_INIT;
  config.device = ordinal;
  lwo_status_t s = lwo_engine_create(&config, device.engine.out());
  if (s == LWO_ERR_NO_DEVICE) fail(lwo_last_error_message());
  check(s, "lwo_engine_create");
}

std::string describe(const Device& device) {
  return strf("device %d: %s (%d SMs, %s)", device.ordinal, device.prop.name,
              device.prop.multiProcessorCount, fmt_bytes(device.prop.totalGlobalMem).c_str());
}

std::string json_device(const Device& device) {
  return strf(
      "{\"ordinal\": %d, \"name\": %s, \"sms\": %d, \"memory_bytes\": %zu, "
      "\"pci_bus\": %d}",
      device.ordinal, json_string(device.prop.name).c_str(), device.prop.multiProcessorCount,
      device.prop.totalGlobalMem, device.prop.pciBusID);
}

double measure_h2d_peak(const std::vector<HostRange>& records, uint64_t record_bytes,
                        double* best_ms) {
  DeviceMem buffer = device_alloc(record_bytes);
  Stream stream = make_stream();
  Event a = make_event(), b = make_event();
  uint64_t total = 0;
  for (const HostRange& r : records) total += r.bytes;
  CHECK(cudaMemcpyAsync(buffer.get(), records[0].data, records[0].bytes, cudaMemcpyHostToDevice,
                        stream.get()));  // warm-up
  double best = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < kPeakRepeats; ++rep) {
    CHECK(cudaEventRecord(a.get(), stream.get()));
    for (const HostRange& r : records)
      CHECK(cudaMemcpyAsync(buffer.get(), r.data, r.bytes, cudaMemcpyHostToDevice, stream.get()));
    CHECK(cudaEventRecord(b.get(), stream.get()));
    CHECK(cudaEventSynchronize(b.get()));
    best = std::min<double>(best, elapsed_ms(a, b));
  }
  *best_ms = best;
  return static_cast<double>(total) / (best * 1e6);
}

double measure_d2h_peak(uint64_t chunk_bytes, uint32_t n_chunks, double* best_ms) {
  DeviceMem buffer = device_alloc(chunk_bytes);
  PinnedMem host;
  check(cudaHostAlloc(host.out(), chunk_bytes, cudaHostAllocDefault),
        strf("cudaHostAlloc(%s)", fmt_bytes(chunk_bytes).c_str()).c_str());
  Stream stream = make_stream();
  Event a = make_event(), b = make_event();
  CHECK(cudaMemsetAsync(buffer.get(), 0, chunk_bytes, stream.get()));
  CHECK(cudaMemcpyAsync(host.get(), buffer.get(), chunk_bytes, cudaMemcpyDeviceToHost,
                        stream.get()));  // warm-up
  double best = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < kPeakRepeats; ++rep) {
    CHECK(cudaEventRecord(a.get(), stream.get()));
    for (uint32_t i = 0; i < n_chunks; ++i)
      CHECK(cudaMemcpyAsync(host.get(), buffer.get(), chunk_bytes, cudaMemcpyDeviceToHost,
                            stream.get()));
    CHECK(cudaEventRecord(b.get(), stream.get()));
    CHECK(cudaEventSynchronize(b.get()));
    best = std::min<double>(best, elapsed_ms(a, b));
  }
  *best_ms = best;
  return static_cast<double>(chunk_bytes) * n_chunks / (best * 1e6);
}

void stream_pass(lwo_schedule* schedule, cudaStream_t stream, unsigned long long* sums) {
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
  for (;;) {
    lwo_status_t s = lwo_schedule_next(schedule, stream, &view);
    if (s == LWO_END) break;
    check(s, "lwo_schedule_next");
    check(lwo::kernels::checksum_async(view.base, view.record_bytes, sums + view.layer, stream),
          "lwo::kernels::checksum_async");
  }
  CHECK(lwo_schedule_reset(schedule, stream));
}

// --- command line -----------------------------------------------------------

bool parse_flags(int argc, char** argv, int first, const std::vector<Flag>& flags) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    std::string name = arg, value;
    bool inline_value = false;
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    auto it =
        std::find_if(flags.begin(), flags.end(), [&](const Flag& f) { return name == f.name; });
    if (it == flags.end())
      throw UsageError(arg.rfind("-", 0) == 0 ? strf("unknown flag '%s'", name.c_str())
                                              : strf("unexpected argument '%s'", arg.c_str()));
    if (it->on_set) {
      if (inline_value) throw UsageError(strf("%s takes no value", it->name));
      it->on_set();
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw UsageError(strf("%s needs a value", it->name));
      value = argv[++i];
    }
    it->set(value);
  }
  return true;
}

namespace {

enum class Number { kOk, kMalformed, kTooLarge };

// A whole number in decimal, or in hexadecimal after 0x.
Number to_u64(const std::string& text, uint64_t* out) {
  const char* s = text.c_str();
  int base = 10;
  if (text.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s += 2;
    base = 16;
  }
  if (!std::isxdigit(static_cast<unsigned char>(*s))) return Number::kMalformed;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, base);
  if (*end != '\0') return Number::kMalformed;
  if (errno == ERANGE) return Number::kTooLarge;
  *out = v;
  return Number::kOk;
}

std::string range_text(uint64_t min, uint64_t max, bool sizes) {
  if (sizes) return fmt_bytes(min) + " and " + fmt_bytes(max);
  return strf("%llu and %llu", static_cast<unsigned long long>(min),
              static_cast<unsigned long long>(max));
}

}  // namespace

uint64_t parse_uint(const char* flag, const std::string& text, uint64_t min, uint64_t max) {
  uint64_t v = 0;
  Number n = to_u64(text, &v);
  if (n == Number::kMalformed)
    throw UsageError(strf("%s: '%s' is not a whole number", flag, text.c_str()));
  if (n == Number::kTooLarge || v < min || v > max)
    throw UsageError(strf("%s: %s is out of range (must be between %s)", flag, text.c_str(),
                          range_text(min, max, false).c_str()));
  return v;
}

uint64_t parse_size(const char* flag, const std::string& text, uint64_t min, uint64_t max) {
  size_t n = text.find_first_not_of("0123456789");
  std::string digits = text.substr(0, n), suffix = n == std::string::npos ? "" : text.substr(n);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::pair<const char*, int> kUnits[] = {
      {"", 0},    {"B", 0},    {"K", 10}, {"KB", 10}, {"KIB", 10}, {"M", 20},
      {"MB", 20}, {"MIB", 20}, {"G", 30}, {"GB", 30}, {"GIB", 30}};
  int shift = -1;
  for (const auto& [unit, bits] : kUnits)
    if (suffix == unit) shift = bits;
  uint64_t v = 0;
  Number parsed = digits.empty() || shift < 0 ? Number::kMalformed : to_u64(digits, &v);
  if (parsed == Number::kMalformed)
    throw UsageError(strf("%s: '%s' is not a size (a whole number, optionally with K, M or G)",
                          flag, text.c_str()));
  bool overflow = parsed == Number::kTooLarge || (v << shift) >> shift != v;
  v <<= shift;
  if (overflow || v < min || v > max)
    throw UsageError(strf("%s: %s is out of range (must be between %s)", flag, text.c_str(),
                          range_text(min, max, true).c_str()));
  return v;
}

std::vector<uint64_t> parse_size_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max) {
  std::vector<uint64_t> out;
  size_t b = 0;
  for (;;) {
    size_t e = text.find(',', b);
    out.push_back(parse_size(flag, text.substr(b, e == std::string::npos ? e : e - b), min, max));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string parse_path(const char* flag, const std::string& text) {
  if (text.empty()) throw UsageError(strf("%s needs a file name", flag));
  return text;
}

lwo_dtype_t parse_dtype(const char* flag, const std::string& text) {
  std::string names;
  for (int d = LWO_DTYPE_F32; d <= LWO_DTYPE_U8; ++d) {
    auto dtype = static_cast<lwo_dtype_t>(d);
    if (text == lwo_dtype_name(dtype)) return dtype;
    names += (names.empty() ? "" : ", ") + std::string(lwo_dtype_name(dtype));
  }
  throw UsageError(strf("%s: unknown dtype '%s' (one of %s)", flag, text.c_str(), names.c_str()));
}

// --- host work over all cores ----------------------------------------------

void parallel_for(size_t n, const std::function<void(size_t)>& fn, unsigned n_threads) {
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  size_t n_workers = std::min<size_t>(n, n_threads ? n_threads : hw);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  std::vector<std::thread> threads;
  try {
    for (size_t t = 1; t < n_workers; ++t) threads.emplace_back(work);
  } catch (const std::system_error&) {  // fewer threads than asked for: the others share
  }
  work();
  for (auto& t : threads) t.join();
}

void fill_random(const std::vector<HostRange>& ranges, uint64_t seed) {
  constexpr uint64_t kChunk = uint64_t(4) << 20;  // bytes per work item, a multiple of 8
  struct Item {
    size_t range;
    uint64_t offset;
  };
  std::vector<Item> items;
  for (size_t r = 0; r < ranges.size(); ++r)
    for (uint64_t off = 0; off < ranges[r].bytes; off += kChunk) items.push_back({r, off});
  parallel_for(items.size(), [&](size_t i) {
    const HostRange& range = ranges[items[i].range];
    uint64_t key = mix64(seed ^ mix64(items[i].range + 1));
    auto* p = static_cast<uint8_t*>(range.data);
    uint64_t off = items[i].offset, end = std::min(range.bytes, off + kChunk);
    auto word = [&](uint64_t at) { return mix64(key + (at / 8 + 1) * kGolden); };
    for (; off + 8 <= end; off += 8) {
      uint64_t w = word(off);
      std::memcpy(p + off, &w, 8);
    }
    if (off < end) {
      uint64_t w = word(off);
      std::memcpy(p + off, &w, end - off);
    }
  });
}

std::vector<uint64_t> checksums(const std::vector<HostRange>& ranges) {
  std::vector<uint64_t> out(ranges.size());
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  if (ranges.size() >= hw) {  // one range per core at a time
    parallel_for(ranges.size(), [&](size_t i) {
      out[i] = lwo::kernels::checksum_host(ranges[i].data, ranges[i].bytes, 1);
    });
  } else {  // all cores on each range
    for (size_t i = 0; i < ranges.size(); ++i)
      out[i] = lwo::kernels::checksum_host(ranges[i].data, ranges[i].bytes, 0);
  }
  return out;
}

// --- formatting and output --------------------------------------------------

std::string version_text() {
  unsigned v = lwo_version();
  return strf("%u.%u.%u", v / 10000, v / 100 % 100, v % 100);
}

std::string fmt_bytes(uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && bytes >= (uint64_t(1) << (10 * (u + 1)))) ++u;
  uint64_t unit = uint64_t(1) << (10 * u);
  if (bytes % unit == 0)
    return strf("%llu %s", static_cast<unsigned long long>(bytes / unit), units[u]);
  return strf("%.2f %s", static_cast<double>(bytes) / static_cast<double>(unit), units[u]);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double seconds_since(double start) { return now_seconds() - start; }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

JsonFile::~JsonFile() {
  if (!f_) return;
  std::fclose(f_);
  std::remove(path_.c_str());
}

void JsonFile::open(const std::string& path) {
  f_ = std::fopen(path.c_str(), "w");
  if (!f_) fail(strf("cannot write the JSON file '%s': %s", path.c_str(), std::strerror(errno)));
  path_ = path;
}

void JsonFile::commit() {
  if (!f_) return;
  bool ok = !std::ferror(f_);
  ok = std::fclose(f_) == 0 && ok;
  f_ = nullptr;
  if (!ok) fail(strf("writing the JSON file '%s' failed", path_.c_str()));
  progress("lwo: wrote %s", path_.c_str());
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += strf("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

void progress(const char* fmt, ...) {
  if (g_quiet) return;
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

void print_ring_stats(const lwo_ring_stats& s, bool timing) {
  std::printf("%-10s %llu stages, %llu hits, %llu copies, %s copied (warm-up included)",
              "ring stats", static_cast<unsigned long long>(s.n_stages),
              static_cast<unsigned long long>(s.n_hits),
              static_cast<unsigned long long>(s.n_copies), fmt_bytes(s.bytes_copied).c_str());
  if (timing)
    std::printf("; copies %.2f ms on the GPU (%.2f GB/s), consumers waited %.2f ms", s.copy_ms,
                s.bandwidth_gbps, s.wait_ms);
  std::printf("\n");
}

}  // namespace cli
