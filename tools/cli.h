// Shared pieces of the lwo program: the commands and their flags, progress
// on stderr, the pinned H2D peak of a list of copies, text escaping and JSON
// output. The harness (checks that throw testkit::Error, owners of lwo
// handles and CUDA resources, the generator, host fills and checksums, the
// copy loop, the training workload) is testkit/, shared with bench/ and
// tests/gpu: main reports a testkit::Error as one line and exits 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lwo.h"
#include "src/common/dtype.h"
#include "testkit/check.h"
#include "testkit/checksum.h"
#include "testkit/copy.h"
#include "testkit/owner.h"
#include "testkit/plan.h"
#include "testkit/random.h"

namespace cli {

// The harness (testkit/), as the commands name it: check and TK_CHECK throw
// testkit::Error("CALL failed: STATUS: message"); the owners, the peaks, the
// plan report (testkit/plan.h), time_passes (the timed passes of lwo run and
// lwo stream), strf and fmt_bytes ("256 KiB", "1.50 GiB").
using lwo::align_up;
using namespace testkit;

// Exit status: 0 success, 1 a runtime failure, 2 a usage error.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Matrix dimensions and token counts: lwo_linear_* take int32-sized ones.
constexpr int64_t kMaxDim = (int64_t(1) << 31) - 1;

// The record bytes of `layer` (lwo_record_layout); a layout the library
// refuses is a usage error with its message.
uint64_t record_bytes(const lwo_layer_desc& layer);
// The bytes of `layers` records of `record` bytes; a usage error past 64 bits.
uint64_t model_bytes(uint64_t record, uint32_t layers);

// The program ("lwo"; "bench_shard" for the sharded benchmark, which is
// one command alone) and the command being run ("run"), for messages:
// "lwo run: ...". g_command is empty before a command is chosen, and in
// bench_shard; g_running is the command being run (its --help).
extern std::string g_program;
extern std::string g_command;
struct Command;
extern const Command* g_running;
std::string prefix();  // "lwo run", "lwo" or "bench_shard"

// A reason to stop, already printed to stderr; main turns it into exit 1.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A bad command line (or a pattern or name list the checkpoint refuses), not
// yet printed: main prints "lwo CMD: <message>" and one hint line, exit 2.
// The hint defaults to "run 'lwo CMD --help' for the flags".
struct UsageError : std::runtime_error {
  explicit UsageError(const std::string& message, std::string hint_line = {})
      : std::runtime_error(message), hint(std::move(hint_line)) {}
  std::string hint;
};

// main(): body(argc, argv) with its failures turned into the exit status
// (a UsageError printed with its hint: 2; a Failure, already printed, or
// any other exception, printed: 1), and 1 where stdout could not be written
// or a release failed.
int run_program(int argc, char** argv, int (*body)(int argc, char** argv));
// Where the results and the messages go: stdout and stderr, but for a
// process that runs a command with its output in memory (fuzz/info_fuzz.cc).
extern std::FILE* g_out;
extern std::FILE* g_err;
// The body of the lwo program: argv[1] names the command (tools/lwo.cc).
int dispatch(int argc, char** argv);

// Prints "lwo CMD: <message>" (and a second line, the hint) to stderr and
// throws Failure.
[[noreturn]] void fail(const std::string& message, const std::string& hint = {});

// The CUDA device and the engine on it.
struct Device {
  Device() = default;  // none
  // The engine on CUDA device `device`; without a usable GPU it stops with
  // the library's own message (no driver, no GPU, a GPU too old, a driver
  // older than the runtime) and a hint line.
  explicit Device(int device);
  int ordinal = 0;
  cudaDeviceProp prop{};
  Engine engine;
};
// The same into `device`, but returns false with the library's message in
// *why when lwo_engine_create says there is no device.
bool try_open_device(int ordinal, Device& device, std::string* why);
std::string describe(const Device& device);  // "device 0: NVIDIA H200 (132 SMs, 140 GiB)"

// A command's --json results: keys in the order they are set.
using Json = nlohmann::ordered_json;
Json json_device(const Device& device);  // ordinal, name, sms, memory_bytes, pci_bus
Json json_device(int ordinal, const cudaDeviceProp& prop);
// {"tool": "lwo", "command": command, "version": "0.6.0"}: every file begins
// so; with `device`, its "device" (json_device) follows.
Json json_doc(const char* command, const Device* device = nullptr);

// --- commands and flags ------------------------------------------------------

// One flag: "--name VALUE" or "--name=VALUE", or a switch that takes no
// value. Its help line is generated from `value` and `help`.
struct Flag {
  std::string name;   // "--depth"
  std::string value;  // the value's placeholder ("D"); empty for a switch
  std::string help;   // "ring depth (device slots), 1..4096 (default 2)"
  std::function<void(const std::string& value)> set;  // flags with a value
  std::function<void()> on;                           // switches
  // A flag this command no longer has: given the next argument (or the
  // inline value), throws the UsageError that says where it went. Not listed.
  std::function<void(const std::string& next)> moved;
  bool hidden() const { return static_cast<bool>(moved); }
};

Flag value_flag(const char* name, const char* value, std::string help,
                std::function<void(const std::string&)> set);
Flag switch_flag(const char* name, std::string help, std::function<void()> on);
// A flag whose value is one of `choices`, handed to set(); any other value V
// is a usage error "NAME V <refusal>" ("--order x is neither batch nor layer").
Flag choice_flag(const char* name, const char* value, std::string help,
                 std::vector<std::string> choices, std::string refusal,
                 std::function<void(const std::string&)> set);
// A switch that sets `target` to `value`.
Flag switch_flag(const char* name, std::string help, bool& target, bool value = true);
// A flag this command does not have, not listed: throws UsageError(message,
// hint); "{FILE}" in the message becomes the next argument (escaped), or FILE
// when there is none or it is a flag.
Flag moved_flag(const char* name, std::string message, std::string hint = {});

// A whole number in [min, max]: "--depth -1 is not in 1..4096".
uint64_t parse_uint(const std::string& flag, const std::string& text, uint64_t min, uint64_t max);
std::string range_text(uint64_t min, uint64_t max);  // "1..4096"

// A flag whose value is a whole number in [min, max], stored into `target`;
// the help reads "<what>, min..max (default <target's value now>)".
template <class T>
Flag uint_flag(const char* name, const char* value, T& target, uint64_t min, uint64_t max,
               const std::string& what) {
  std::string help = what + ", " + range_text(min, max) +
                     strf(" (default %llu)", static_cast<unsigned long long>(target));
  return value_flag(name, value, help, [name, &target, min, max](const std::string& v) {
    target = static_cast<T>(parse_uint(name, v, min, max));
  });
}

// The flags several commands share: one name, one range, one wording. The
// whole-number ones are specs: uint_flag(kDepthFlag, o.depth).
struct UintSpec {
  const char* name;   // "--depth"
  const char* value;  // "D"
  uint64_t min, max;
  const char* what;  // the help, before the range
};
template <class T>
Flag uint_flag(const UintSpec& s, T& target) {
  return uint_flag(s.name, s.value, target, s.min, s.max, s.what);
}
constexpr UintSpec kDeviceFlag = {"--device", "N", 0, 1023, "CUDA device ordinal"};
constexpr UintSpec kDepthFlag = {"--depth", "D", 1, LWO_MAX_RING_DEPTH,
                                 "ring depth (device slots)"};
constexpr UintSpec kLayersFlag = {"--layers", "N", 1, 1000000, "layers of the model"};
constexpr UintSpec kRowsFlag = {"--rows", "R", 1, kMaxDim,
                                "rows of each layer's tensor \"weight\""};
constexpr UintSpec kColsFlag = {"--cols", "C", 1, kMaxDim,
                                "columns of each layer's tensor \"weight\""};
constexpr UintSpec kTokensFlag = {"--tokens", "T", 1, kMaxDim, "tokens per training step"};
constexpr UintSpec kPassesFlag = {"--passes", "P", 1, 100000,
                                  "timed passes, after one warm-up pass"};
constexpr UintSpec kStepsFlag = {"--steps", "S", 1, 100000,
                                 "timed training steps, after one warm-up step"};
constexpr UintSpec kGradDepthFlag = {"--grad-depth", "G", 1, 64, "gradient staging slots"};
constexpr UintSpec kSeedFlag = {"--seed", "S", 0, UINT64_MAX, "seed of the random weights"};
Flag timing_flag(bool& timing);
Flag json_flag(std::string& path);
Flag quiet_flag();
// --dtype: one of `allowed` (lwo dtypes), default `dtype`.
Flag dtype_flag(lwo_dtype_t& dtype, const std::vector<lwo_dtype_t>& allowed);
// The synthetic model of lwo run, plan and train on one device: every layer
// one tensor "weight" [rows x cols] (weight()).
struct ModelOptions {
  int device = 0;
  uint32_t layers = 32;
  int64_t rows = 8192, cols = 8192;
  lwo_dtype_t dtype = LWO_DTYPE_BF16;
  lwo_tensor_desc weight() const { return tensor_desc("weight", dtype, {rows, cols}); }
};
// Their "model" line of results: `record` bytes per layer, `total` in all.
void print_model(const ModelOptions& m, uint64_t record, uint64_t total);
// --layers, --rows, --cols and --dtype (any dtype) of lwo run and lwo plan,
// then `more`.
std::vector<Flag> model_flags(ModelOptions& m, std::vector<Flag> more);
// --quant fp8|fp8-block|int8|int4: the weights quantized on
// load (LWO_EXT_TENSOR_QUANT) in that format; LWO_QUANT_NONE without it.
Flag quant_flag(lwo_quant_format_t& format);
// The flag's spelling of a format ("fp8-block"), "none" for LWO_QUANT_NONE.
const char* quant_flag_name(lwo_quant_format_t format);
// Checkpoint mapping: --pattern P (repeatable) and --names FILE.
struct CkptSpec;
Flag pattern_flag(CkptSpec& spec);
Flag names_flag(CkptSpec& spec);

// One subcommand of lwo.
struct Command {
  const char* name;      // "stream"
  const char* operands;  // "FILE...", or "" when it takes none
  const char* summary;   // one line of `lwo help`
  const char* about;     // what it does, for `lwo help COMMAND` (lines end in \n)
  // Its flags, bound to a throwaway: for help, and to say which command has
  // a flag given to another. Null for help and version (no flags).
  std::vector<Flag> (*flags)();
  int (*main)(int argc, char** argv);  // argv[1] is the command's name
};
// A command's `flags`: make(o) bound to a throwaway O (a command's Options).
template <class O, std::vector<Flag> (*make)(O&)>
std::vector<Flag> throwaway_flags() {
  static O o;
  return make(o);
}
extern const Command kProbeCommand, kRunCommand, kTrainCommand, kStreamCommand, kInfoCommand;

// ---- the planner (tools/plan.cc) ----
extern const Command kPlanCommand;
// The flags lwo run and lwo train share, in their order: --seed, --timing,
// --device, --json, --quiet, --budget.
std::vector<Flag> pass_flags(uint64_t& seed, bool& timing, int& device, std::string& json,
                             std::string& budget);
// The flags of each part, in order.
std::vector<Flag> joined(std::initializer_list<std::vector<Flag>> parts);
// The budget in bytes for a model of `model_bytes` ("" is 0: none).
uint64_t parse_budget(const std::string& text, uint64_t model_bytes);
// What of `budget` a plan may use: the budget less what the engine holds
// that a plan does not count (compute workspaces; the plan counts the ring,
// the resident layers and the gradient staging). Throws a UsageError if
// nothing is left.
uint64_t plan_budget(lwo_engine* engine, uint64_t budget);
// The per-layer table of `lwo plan` (and of run / train with --budget).
void print_plan(const PlanReport& r);
Json json_plan(const PlanReport& r);
// The command table, in `lwo help` order (help and version last): the
// overview, the usage lines and the no-command message come from it.
const std::vector<const Command*>& commands();
void print_command_help(const Command& c, std::FILE* out);

// Applies argv[2..argc) to `flags`. Arguments that are not flags (and all
// after "--") go to *operands, or are an error when operands is NULL. A
// later value of the same flag replaces an earlier one (--pattern adds).
// Returns false (having applied nothing, and printed the command's help to
// stdout) when --help or -h is among them.
bool parse_flags(int argc, char** argv, const std::vector<Flag>& flags,
                 std::vector<std::string>* operands = nullptr);

// A byte count: a whole number with an optional K, M or G suffix (powers of
// 1024; KiB, MiB, GiB also accepted).
uint64_t parse_size(const std::string& flag, const std::string& text, uint64_t min, uint64_t max);
std::string parse_path(const std::string& flag, const std::string& text);  // non-empty

// --- progress on stderr -----------------------------------------------------
//
// Results go to stdout; progress to stderr. On a terminal (stderr is a tty
// and TERM is not "dumb") the phase running now shows a bar, redrawn in
// place and cleared when the phase ends, and each phase leaves one line.
// Elsewhere only those lines. --quiet: nothing (results still print).

extern bool g_quiet;
// One line, printed whole (above the bar, if one is showing). Any thread.
void progress(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Writes `text` to stderr whole, the bar cleared first; not silenced by
// --quiet (for errors). Any thread.
void print_stderr(const std::string& text);

// With `depth` >= `layers`: "note: depth D >= L layers: after <after> every
// layer stays in a slot, so <units> hit and copy nothing".
void note_depth(uint32_t depth, uint32_t layers, const char* after, const char* units);

// One phase of long work: pool creation and fill, passes, steps.
class Phase {
 public:
  // `total` units of work; 0 when unknown (the bar then shows the time
  // only). With `bytes`, units are bytes and shown as such.
  explicit Phase(std::string label, uint64_t total = 0, bool bytes = false);
  ~Phase();  // clears the bar if done() was not called (a failure)
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;
  void set(uint64_t done, const std::string& detail = {});  // any thread
  Progress counter();  // add() as testkit's progress callback
  // Ends the phase: clears the bar, prints "<label>: <text>" (both modes).
  void done(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  // Ends the phase without a line.
  void end();
  double seconds() const;  // since the phase began

  struct State;  // tools/progress.cc

 private:
  State* s_;
};

// --- the peaks ---------------------------------------------------------------

// Raw pinned-copy peaks (testkit::time_copies, testkit::time_h2d_copies): the
// best of kPeakRepeats timed batches after one untimed batch (best_gbps(),
// best_ms()).
constexpr int kPeakRepeats = 3;
constexpr CopyRepeats kPeak = {1, kPeakRepeats};

// --- checksums -----------------------------------------------------------------

// The per-layer sums on the device against `times` x `expect`
// (testkit::verify_sums), copied back on the legacy default stream (every
// stream in flight is non-blocking, so the copy waits for none of them; the
// caller has waited for the sums). line(m) goes to stderr for each of the
// first 8 mismatches; returns them all.
std::vector<SumMismatch> check_sums(
    const unsigned long long* sums, const std::vector<uint64_t>& expect, uint64_t times,
    const std::function<std::string(const SumMismatch&)>& line);

// --- formatting and output --------------------------------------------------

std::string version_text();             // lwo_version() as "0.2.0"
// One line of a command's results on stdout: `label` in 10 columns, a
// space, the text of fmt, a newline ("time       median 1.234 ms, ...").
void print_row(const char* label, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// The "ring stats" line of `lwo run`: stages, hits, copies, bytes (and the
// timing figures when the ring was created with LWO_RING_TIMING).
void print_ring_stats(const lwo_ring_stats& s, bool timing);
// {"depth", "slot_bytes", "stages", "hits", "copies", "bytes_copied"} and with
// timing "copy_ms", "wait_ms", "copy_gbps": the ring of lwo run and lwo stream.
Json json_ring(const lwo_ring_info& ring, const lwo_ring_stats& s, bool timing);
// The timed passes of lwo run and lwo stream (their results derive from it):
// `pass_bytes` a pass through the ring, against the pinned H2D peak.
struct PassResults : TimedPasses {
  uint64_t pass_bytes = 0;
  double peak_gbps = 0, peak_ms = 0;
  lwo_ring_info ring{};
  lwo_ring_stats stats{};
  double gbps(double t) const { return testkit::gbps(static_cast<double>(pass_bytes), t); }
  double share(double t) const { return peak_gbps > 0 ? gbps(t) / peak_gbps : 0; }
  // The times of time_passes and the ring's statistics after them.
  void take(const TimedPasses& t, lwo_ring* r);
  // "pass 2/5: 1.234 ms, 50.00 GB/s, 99.00% of the peak": the phase's detail.
  std::string pass_line(uint32_t p, uint32_t passes, double t) const;
  // The "ring", "passes", "time" and "bandwidth" lines, then "share" up to
  // "of the peak" (the caller ends the line).
  void print(uint32_t passes, bool timing) const;
  // "peak", "pass_ms", "median_ms", "best_ms", "gbps" and "share_of_peak".
  void to_json(Json& j, uint32_t passes) const;
};

// Text from a file or the command line made safe for a terminal, as the
// library's checkpoint messages quote it: '"' and '\' get a backslash,
// control characters (C0, DEL, C1) and bytes that are not valid UTF-8 become
// \xNN; printable ASCII and valid UTF-8 stay. escape() adds no quotes;
// quoted() adds them and cuts after `max` bytes ("..." (N bytes)).
std::string escape(const std::string& s);
std::string quoted(const std::string& s, size_t max = 160);
// The same for a modifiable string (a better match than std::quoted, which
// nlohmann/json's <iomanip> brings in through argument-dependent lookup).
inline std::string quoted(std::string& s, size_t max = 160) {
  return quoted(static_cast<const std::string&>(s), max);
}

// A JSON file opened before the work starts (so a bad path fails early).
// For a regular file (or a new one) the results go to a temporary file in
// the same folder, renamed over the path by write(): a run that fails
// leaves the path as it was (the temporary file is removed). Anything else
// (/dev/stdout, a pipe) is written in place.
class JsonFile {
 public:
  explicit JsonFile(const std::string& path) { open(path); }
  JsonFile(const JsonFile&) = delete;
  JsonFile& operator=(const JsonFile&) = delete;
  ~JsonFile();
  void open(const std::string& path);  // nothing when path is empty
  bool is_open() const { return f_ != nullptr; }
  // The one emitter of every command's results: `doc` (an object) with a
  // key a line, each value on that line, an array of objects an element a
  // line (bench_shard's results: scripts/scale greps them); strings always
  // valid JSON (bytes that are not UTF-8 as U+FFFD). Then closes and
  // renames; fails if the write failed.
  void write(const Json& doc);

 private:
  std::FILE* f_ = nullptr;
  std::string path_;    // as given (for messages)
  std::string target_;  // what write() renames the temporary file to
  std::string temp_;    // the temporary file; empty when written in place
};

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
  // An fp8 weight with its block scales (LWO_QUANT_FP8_E4M3_BLOCK128),
  // and the index of the partner (the scales, or for scales their weight).
  int32_t quant_format = LWO_QUANT_NONE;
  uint32_t quant_partner = LWO_NO_LAYER;
  std::string lwo_dtype() const;  // "bf16", or "BF16?" when lwo has no such dtype
};

// One file of a checkpoint (lwo_checkpoint_file_info).
struct CkptFile {
  std::string path;  // as opened
  std::string name;  // its last component
  uint64_t bytes = 0;
  uint32_t n_tensors = 0;
};

// One "__metadata__" entry (lwo_checkpoint_metadata).
struct CkptMeta {
  uint32_t file = 0;
  std::string key, value;
};

// How tensors become layers, as the command line says.
struct CkptSpec {
  std::vector<std::string> patterns;  // --pattern, in order
  std::string names_file;             // --names
};

// The patterns tried, in order, when none is given: "model.layers.{i}.", ...
std::string default_patterns_text();

// Tensors mapped to layers, as the library maps them.
struct CkptMap {
  std::vector<std::string> patterns;           // used; empty with names
  bool is_default = false;                     // a default pattern, picked
  std::string names_file;                      // with names
  std::vector<std::vector<std::string>> names;  // from names_file, per layer
  std::vector<std::vector<uint32_t>> layers;   // tensor indices, in file order
  std::vector<uint32_t> unmatched;             // tensor indices, in file order
  std::vector<uint32_t> gaps;                  // layers without tensors
  // "the pattern \"blocks.{i}.\"", "the patterns ...", "the names in F".
  std::string describe() const;
  // Storage the config points into.
  std::vector<const char*> pattern_ptrs, name_ptrs;
  std::vector<uint32_t> n_names;
};

// What a checkpoint lists: its files, metadata and tensors, in file order.
struct CkptListing {
  std::string path;  // as opened
  std::vector<CkptFile> files;
  std::vector<CkptMeta> metadata;
  std::vector<CkptTensor> tensors;
};
// Opens `path` into `ck` (needs no GPU) and reads what it lists into *out; a
// bad file stops with the library's message and status. The library refuses
// anything that is not a regular file without blocking; nothing here touches
// the path first.
void open_checkpoint(const std::string& path, Checkpoint& ck, CkptListing* out);
// parse_flags for lwo info and lwo stream: the operands are checkpoint FILEs,
// at least one (else a usage error). False after --help.
bool parse_checkpoint_args(int argc, char** argv, const std::vector<Flag>& flags,
                           std::vector<std::string>* paths);
// Maps the tensors by `spec` (patterns, or names), or by the first default
// pattern that maps any tensor when it gives neither. Returns false (and an
// empty map) if no default pattern maps any tensor. `flags` may hold
// LWO_CHECKPOINT_ALLOW_GAPS (gaps are then listed in map->gaps). A mapping
// the library refuses (no "{i}", nothing matched, a missing layer index or
// name) is a usage error with the library's message and `hint`.
bool map_checkpoint(lwo_checkpoint* checkpoint, const std::vector<CkptTensor>& tensors,
                    const CkptSpec& spec, uint32_t flags, const std::string& hint, CkptMap* map);
// The config lwo_pool_create_from_checkpoint needs for `map` (which must
// outlive it and not move).
lwo_checkpoint_pool_config checkpoint_pool_config(CkptMap& map, uint32_t flags);
// {"names_file": ..., "patterns": [...], "pattern_source": "default" | "given"}
Json json_mapping(const CkptMap& map);

}  // namespace cli
