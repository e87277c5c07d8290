// Shared pieces of the lwo program: error checks, owners of lwo handles and
// CUDA resources, flag parsing, host-side fill and checksum, JSON output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lwo.h"

namespace cli {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
extern const char* const kUsage;

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// A reason to stop, already printed to stderr; main turns it into exit 1.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A bad command line, not yet printed; main prints it with the usage, exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Prints "lwo: <message>" to stderr and throws Failure.
[[noreturn]] void fail(const std::string& message);

// Stops with the call's text, the status name and the library's message.
void check(lwo_status_t status, const char* call);
void check(cudaError_t error, const char* call);
#define CHECK(call) ::cli::check((call), #call)

// Set when releasing something failed during cleanup; main then exits 1.
extern bool g_cleanup_failed;
void report_cleanup(lwo_status_t status, const char* call);
void report_cleanup(cudaError_t error, const char* call);

// Owns one lwo handle or CUDA resource of type T, released by `Free` (named
// `Name` in messages). Release failures are reported, never thrown.
template <class T, auto Free, const char* Name>
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
  // For create calls that write the new resource through a pointer.
  T* out() {
    reset();
    return &p_;
  }
  // Releases now; a failure stops the program.
  void destroy() {
    if (p_) check(Free(std::exchange(p_, T{})), Name);
  }
  // Releases now; a failure is reported (see g_cleanup_failed).
  void reset() noexcept {
    if (!p_) return;
    auto status = Free(std::exchange(p_, T{}));
    if (status) report_cleanup(status, Name);
  }

 private:
  T p_{};
};

#define CLI_OWNER(Alias, T, Free)                 \
  inline constexpr char k##Alias##Free[] = #Free; \
  using Alias = Owner<T, Free, k##Alias##Free>

CLI_OWNER(Engine, lwo_engine*, lwo_engine_destroy);
CLI_OWNER(Pool, lwo_pool*, lwo_pool_destroy);
CLI_OWNER(Ring, lwo_ring*, lwo_ring_destroy);
CLI_OWNER(Schedule, lwo_schedule*, lwo_schedule_destroy);
CLI_OWNER(Grads, lwo_grads*, lwo_grads_destroy);
CLI_OWNER(Stream, cudaStream_t, cudaStreamDestroy);
CLI_OWNER(Event, cudaEvent_t, cudaEventDestroy);
CLI_OWNER(DeviceMem, void*, cudaFree);
CLI_OWNER(PinnedMem, void*, cudaFreeHost);
CLI_OWNER(Checkpoint, lwo_checkpoint*, lwo_checkpoint_destroy);
#undef CLI_OWNER

Stream make_stream();  // non-blocking
Event make_event();    // with timing
DeviceMem device_alloc(size_t bytes);
float elapsed_ms(const Event& a, const Event& b);  // both must have completed

// Enqueues one pass of `schedule` on `stream`: for each layer, the checksum
// kernel reads the whole record from its slot and adds into sums[layer]. Then
// resets the schedule for the next pass.
void stream_pass(lwo_schedule* schedule, cudaStream_t stream, unsigned long long* sums);

// The CUDA device and the engine on it, or a one-line "no CUDA device" failure.
struct Device {
  int ordinal = 0;
  cudaDeviceProp prop{};
  Engine engine;
};
void open_device(int ordinal, Device& device);
std::string describe(const Device& device);     // "device 0: NVIDIA H200 (132 SMs, 140 GiB)"
std::string json_device(const Device& device);  // a JSON object

// --- command line -----------------------------------------------------------

uint64_t parse_uint(const char* flag, const std::string& text, uint64_t min, uint64_t max);

// One flag: "--name VALUE" or "--name=VALUE", or a switch that takes no value.
struct Flag {
  Flag(const char* flag, std::function<void(const std::string& value)> fn)
      : name(flag), set(std::move(fn)) {}
  Flag(const char* flag, std::function<void()> fn) : name(flag), on_set(std::move(fn)) {}
  const char* name;
  std::function<void(const std::string& value)> set;
  std::function<void()> on_set;
};
// A flag whose value is a whole number in [min, max], stored into `target`.
template <class T>
Flag uint_flag(const char* name, T& target, uint64_t min, uint64_t max) {
  return Flag(name, [name, &target, min, max](const std::string& value) {
    target = static_cast<T>(parse_uint(name, value, min, max));
  });
}

// Applies argv[first..argc) to the flags. Returns false if --help/-h was given.
bool parse_flags(int argc, char** argv, int first, const std::vector<Flag>& flags);

// A byte count: a whole number with an optional K, M or G suffix (powers of
// 1024; KiB, MiB, GiB also accepted).
uint64_t parse_size(const char* flag, const std::string& text, uint64_t min, uint64_t max);
std::vector<uint64_t> parse_size_list(const char* flag, const std::string& text, uint64_t min,
                                      uint64_t max);
std::string parse_path(const char* flag, const std::string& text);  // non-empty
lwo_dtype_t parse_dtype(const char* flag, const std::string& text);

// --- host work over all cores ----------------------------------------------

// Calls fn(i) for i in [0, n) from up to `n_threads` threads (0: all cores).
void parallel_for(size_t n, const std::function<void(size_t)>& fn, unsigned n_threads = 0);

// The splitmix64 finaliser: a counter-based generator, so any word can be
// produced independently of the others.
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills each (pointer, bytes) range with pseudo-random bytes from all cores.
// The bytes depend only on the seed and the range's index and size.
struct HostRange {
  void* data;
  uint64_t bytes;
};
void fill_random(const std::vector<HostRange>& ranges, uint64_t seed);
// lwo::kernels::checksum_host of each range, computed from all cores.
std::vector<uint64_t> checksums(const std::vector<HostRange>& ranges);

// Raw pinned-copy peaks, GB/s of the best of kPeakRepeats rounds (after one
// untimed copy); *best_ms is that round's time.
constexpr int kPeakRepeats = 3;
// H2D: every record copied back-to-back into one device buffer on one stream.
double measure_h2d_peak(const std::vector<HostRange>& records, uint64_t record_bytes,
                        double* best_ms);
// D2H: `n_chunks` copies of `chunk_bytes` back-to-back from one device buffer
// into one pinned host buffer on one stream.
double measure_d2h_peak(uint64_t chunk_bytes, uint32_t n_chunks, double* best_ms);

// --- formatting and output --------------------------------------------------

std::string version_text();             // lwo_version() as "0.2.0"
std::string fmt_bytes(uint64_t bytes);  // "256 KiB", "1.50 GiB"
// The "ring stats" line of `lwo run`: stages, hits, copies, bytes (and the
// timing figures when the ring was created with LWO_RING_TIMING).
void print_ring_stats(const lwo_ring_stats& s, bool timing);
double seconds_since(double start);
double now_seconds();  // monotonic
double median(std::vector<double> v);

// A JSON file opened before the work starts (so a bad path fails early) and
// removed again unless commit() is called.
class JsonFile {
 public:
  JsonFile() = default;
  JsonFile(const JsonFile&) = delete;
  JsonFile& operator=(const JsonFile&) = delete;
  ~JsonFile();
  void open(const std::string& path);
  bool is_open() const { return f_ != nullptr; }
  std::FILE* get() const { return f_; }
  void commit();  // closes; fails if the write failed

 private:
  std::FILE* f_ = nullptr;
  std::string path_;
};
std::string json_string(const std::string& s);  // quoted and escaped

// Progress lines go to stderr unless quiet.
extern bool g_quiet;
void progress(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// --- checkpoints (tools/checkpoint.cc) -------------------------------------

// One tensor of an opened checkpoint, as lwo_checkpoint_tensor_info gives it.
struct CkptTensor {
  std::string name;
  std::string dtype_name;  // as in the file ("BF16")
  int32_t dtype = -1;      // an lwo_dtype_t, or -1 when lwo has no such dtype
  int32_t n_dims = 0;
  std::vector<int64_t> shape;  // the first min(n_dims, LWO_MAX_DIMS) dimensions
  uint64_t bytes = 0;
  uint64_t offset = 0;  // of the first byte, in its file
  uint32_t file = 0;    // index of the shard
};

// The patterns tried, in order, when none is given.
extern const char* const kDefaultPatterns[];
extern const size_t kNumDefaultPatterns;
std::string default_patterns_text();  // "model.layers.{i}.", "blocks.{i}.", ...

// Tensors mapped to layers by a pattern, as the library maps them.
struct CkptMap {
  std::string pattern;       // empty when no default pattern maps any tensor
  bool is_default = false;   // picked from kDefaultPatterns, not given
  std::vector<std::vector<uint32_t>> layers;  // tensor indices, in file order
  std::vector<uint32_t> unmatched;            // tensor indices, in file order
};

// Opens `path` (needs no GPU); a bad file stops with the status and the
// library's message.
void open_checkpoint(const std::string& path, Checkpoint& checkpoint);
std::vector<CkptTensor> checkpoint_tensors(lwo_checkpoint* checkpoint);
// Maps the tensors by `pattern`, or by the first default pattern that maps
// any tensor when `pattern` is empty. Returns false (and an empty map) if no
// default pattern maps any tensor. A pattern the library rejects (no "{i}",
// nothing matched, a missing layer index) stops with its message. The layers
// are checked against the library: the same tensors are left unmatched.
bool map_checkpoint(lwo_checkpoint* checkpoint, const std::vector<CkptTensor>& tensors,
                    const std::string& pattern, CkptMap* map);
// The config lwo_pool_create_from_checkpoint needs for `map` (which must
// outlive it).
lwo_checkpoint_pool_config checkpoint_pool_config(const CkptMap& map, uint32_t flags);
std::string shape_text(const CkptTensor& t);  // "[4096, 4096]"
uint64_t align_up(uint64_t v, uint64_t a);

int cmd_probe(int argc, char** argv);
int cmd_run(int argc, char** argv);
// lwo run --train / --frozen (tools/train.cc). run_wants_train tells cmd_run
// to hand over; it throws UsageError for a training flag without --train.
bool run_wants_train(int argc, char** argv);
int cmd_train(int argc, char** argv);
// lwo run --weights FILE (tools/run_weights.cc): streams a safetensors
// checkpoint. run_wants_weights tells cmd_run to hand over; it throws
// UsageError for a flag that does not apply (a synthetic-model or training
// flag with --weights, a checkpoint flag without it).
bool run_wants_weights(int argc, char** argv);
int cmd_run_weights(int argc, char** argv);
// lwo info FILE (tools/info.cc): a checkpoint's tensors, layers and ring size.
int cmd_info(int argc, char** argv);
// lwo shard (tools/shard.cc): host weights sharded across the GPUs of this
// machine, one NCCL rank (thread) per GPU; bandwidth against the rank count.
int cmd_shard(int argc, char** argv);

}  // namespace cli
