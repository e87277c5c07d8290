#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>

#include "testkit/check.h"

namespace testkit {

std::string strf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
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
  while (u < 4 && bytes >= (uint64_t(1) << (10 * (u + 1)))) ++u;
  const uint64_t unit = uint64_t(1) << (10 * u);
  if (bytes % unit == 0)
    return strf("%llu %s", static_cast<unsigned long long>(bytes / unit), units[u]);
  return strf("%.2f %s", static_cast<double>(bytes) / static_cast<double>(unit), units[u]);
}

namespace {
thread_local FailHook t_fail_hook = nullptr;
}  // namespace

void set_thread_fail_hook(FailHook hook) { t_fail_hook = hook; }

void fail(const std::string& message) {
  if (t_fail_hook) t_fail_hook(message);
  throw Error(message);
}

std::string describe(lwo_status_t status) {
  return strf("%s: %s", lwo_status_string(status), lwo_last_error_message());
}

std::string describe(cudaError_t error) {
  return strf("%s: %s", cudaGetErrorName(error), cudaGetErrorString(error));
}

void check(lwo_status_t status, const char* call) {
  if (status == LWO_OK) return;
  fail(strf("%s failed: %s", call, describe(status).c_str()));
}

void check(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(strf("%s failed: %s", call, describe(error).c_str()));
}

// --- releases -------------------------------------------------------------------

namespace {

std::atomic<unsigned> g_release_failures{0};
std::atomic<ReleaseReporter> g_reporter{nullptr};

void report(const char* call, const std::string& why) {
  ++g_release_failures;
  if (ReleaseReporter r = g_reporter.load()) {
    r(call, why);
    return;
  }
  std::fprintf(stderr, "testkit: %s failed: %s\n", call, why.c_str());
}

}  // namespace

void set_release_reporter(ReleaseReporter reporter) { g_reporter.store(reporter); }

void report_release(const char* call, lwo_status_t status) {
  if (status != LWO_OK) report(call, describe(status));
}

void report_release(const char* call, cudaError_t error) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  report(call, describe(error));
}

unsigned release_failures() { return g_release_failures.load(); }

// --- devices ----------------------------------------------------------------------

const std::string& no_device_reason() {
  static const std::string reason = [] {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      // The library says which of no driver, old driver or no GPU it is.
      lwo_engine* engine = nullptr;
      if (lwo_engine_create(nullptr, &engine) != LWO_OK) return std::string(lwo_last_error_message());
      (void)lwo_engine_destroy(engine);
      return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" +
             cudaGetErrorString(e) + ")";
    }
    if (n <= 0) return std::string("cudaGetDeviceCount reports 0 devices");
    return std::string();
  }();
  return reason;
}

int device_count() {
  if (!no_device_reason().empty()) return 0;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// --- time and statistics ------------------------------------------------------------

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace testkit
