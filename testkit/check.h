// testkit: the harness shared by tools/, bench/ and tests/gpu (testkit/).
//
// Checks: a failed lwo or CUDA call becomes a testkit::Error that names the
// call, the status and the library's message; owners (testkit/owner.h) report
// a failed release through one reporter; the one test for "is there a CUDA
// device". Formatting helpers that every harness needs (strf, fmt_bytes) and
// the steady clock live here too.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "lwo.h"

namespace testkit {

constexpr uint64_t KiB = 1024, MiB = KiB << 10, GiB = MiB << 10;

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string fmt_bytes(uint64_t bytes);  // "256 KiB", "1.50 GiB"

// --- failures -----------------------------------------------------------------

// A failed call or check. Harnesses catch it where one case (a benchmark, a
// rank, a command) stops.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string& message);
// Called on this thread with the message just before fail() (and so every
// check) throws; null: none. For threads that wait for each other (ranks at a
// barrier): the hook tells the others at once, before the stack unwinds and
// its releases perhaps wait for them.
using FailHook = void (*)(const std::string& message);
void set_thread_fail_hook(FailHook hook);

// "LWO_ERR_BUSY: <lwo_last_error_message()>", "cudaErrorMemoryAllocation: out of memory"
std::string describe(lwo_status_t status);
std::string describe(cudaError_t error);

// Throw Error("CALL failed: <describe(status)>") unless the call succeeded. The
// CUDA overload also clears the thread's last CUDA error.
void check(lwo_status_t status, const char* call);
void check(cudaError_t error, const char* call);
inline void check(lwo_status_t status, const std::string& call) { check(status, call.c_str()); }
inline void check(cudaError_t error, const std::string& call) { check(error, call.c_str()); }
#define TK_CHECK(call) ::testkit::check((call), #call)

// --- releases -------------------------------------------------------------------

// Called when an owner's release (lwo_*_destroy, cudaFree, ...) fails; `call`
// names the release function, `why` is describe(status). The default prints
// "testkit: CALL failed: WHY" to stderr. Counted in release_failures() either
// way (a program exits 1 when it is not 0).
using ReleaseReporter = void (*)(const char* call, const std::string& why);
void set_release_reporter(ReleaseReporter reporter);  // nullptr: the default
void report_release(const char* call, lwo_status_t status);
void report_release(const char* call, cudaError_t error);
unsigned release_failures();

// --- devices ----------------------------------------------------------------------

// Why this process has no usable CUDA device, "" when it has one (computed
// once): "cudaGetDeviceCount: cudaErrorNoDevice (no CUDA-capable device is
// detected)", or "cudaGetDeviceCount reports 0 devices".
const std::string& no_device_reason();
int device_count();  // 0 without a device

// --- descriptions -----------------------------------------------------------------

// The description of a tensor `name` of `dtype` and `shape` (no host data,
// no extensions).
inline lwo_tensor_desc tensor_desc(const char* name, lwo_dtype_t dtype,
                                   std::initializer_list<int64_t> shape) {
  lwo_tensor_desc t{};
  t.name = name;
  t.dtype = dtype;
  t.n_dims = static_cast<int32_t>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape);
  return t;
}

// --- time and statistics ------------------------------------------------------------

double now_seconds();  // steady clock
double median(std::vector<double> v);  // 0 for none; the mean of the middle two for an even count
// bytes / (ms * 1e6): GB/s (1e9 B/s); 0 when ms <= 0.
inline double gbps(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0.0; }
// The time bytes take at gbps, in ms; 0 when gbps <= 0.
inline double ms_at(double bytes, double gbps) { return gbps > 0 ? bytes / (gbps * 1e6) : 0.0; }

}  // namespace testkit
