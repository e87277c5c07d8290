#include "tools/cli.h"
#include "src/common/utf8.h"

#include <algorithm>
#include <cctype>
#include <cstdarg>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>

#include <sys/stat.h>
#include <unistd.h>

namespace cli {

std::string g_program = "lwo";
std::string g_command;
const Command* g_running = nullptr;

std::string prefix() { return g_command.empty() ? g_program : g_program + " " + g_command; }

void fail(const std::string& message, const std::string& hint) {
  print_stderr(strf("%s: %s\n%s", prefix().c_str(), message.c_str(),
                    hint.empty() ? "" : (hint + "\n").c_str()));
  throw Failure(message);
}

namespace {

// "run 'lwo run --help' for the flags"
std::string default_hint() {
  if (!g_running) return "run 'lwo help' for the commands";
  return strf("run '%s --help' for the flags", prefix().c_str());
}

// A release that failed in cleanup (an owner's reset, testkit's release
// reporter): "lwo CMD: CALL failed: WHY" on stderr; main then exits 1.
void report_release(const char* call, const std::string& why) {
  print_stderr(strf("%s: %s failed: %s\n", prefix().c_str(), call, why.c_str()));
}

}  // namespace

bool try_open_device(int ordinal, Device& device, std::string* why) {
  // The library says why there is no device (no driver, no GPU, a GPU too
  // old, a driver older than the runtime): ask it first, before any CUDA
  // call of our own.
  lwo_engine_config config = LWO_ENGINE_CONFIG_INIT;
  config.device = ordinal;
  lwo_status_t s = lwo_engine_create(&config, device.engine.out());
  if (s == LWO_ERR_NO_DEVICE) {
    if (why) *why = lwo_last_error_message();
    return false;
  }
  check(s, "lwo_engine_create");
  device.ordinal = ordinal;
  TK_CHECK(cudaSetDevice(ordinal));
  TK_CHECK(cudaGetDeviceProperties(&device.prop, ordinal));
  return true;
}

Device::Device(int device) {
  std::string why;
  if (!try_open_device(device, *this, &why))
    fail(why, "lwo info and lwo help need no GPU; run 'lwo help' for the commands");
}

uint64_t record_bytes(const lwo_layer_desc& layer) {
  uint64_t bytes = 0;
  if (lwo_record_layout(&layer, nullptr, &bytes) != LWO_OK)
    throw UsageError(lwo_last_error_message());
  return bytes;
}

uint64_t model_bytes(uint64_t record, uint32_t layers) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(record, layers, &bytes))
    throw UsageError(
        strf("%u layers of %s do not fit in 64 bits", layers, fmt_bytes(record).c_str()));
  return bytes;
}

std::string describe(const Device& device) {
  return strf("device %d: %s (%d SMs, %s)", device.ordinal, device.prop.name,
              device.prop.multiProcessorCount, fmt_bytes(device.prop.totalGlobalMem).c_str());
}

Json json_device(int ordinal, const cudaDeviceProp& prop) {
  return {{"ordinal", ordinal}, {"name", prop.name}, {"sms", prop.multiProcessorCount},
          {"memory_bytes", prop.totalGlobalMem}, {"pci_bus", prop.pciBusID}};
}

Json json_device(const Device& device) { return json_device(device.ordinal, device.prop); }

Json json_doc(const char* command, const Device* device) {
  Json j = {{"tool", "lwo"}, {"command", command}, {"version", version_text()}};
  if (device) j["device"] = json_device(*device);
  return j;
}

std::vector<SumMismatch> check_sums(
    const unsigned long long* sums, const std::vector<uint64_t>& expect, uint64_t times,
    const std::function<std::string(const SumMismatch&)>& line) {
  constexpr size_t kMaxMismatchLines = 8;
  const std::vector<SumMismatch> bad = verify_sums(sums, expect, times, cudaStreamLegacy);
  for (size_t i = 0; i < bad.size() && i < kMaxMismatchLines; ++i) print_stderr(line(bad[i]));
  return bad;
}

// --- command line -----------------------------------------------------------

Flag value_flag(const char* name, const char* value, std::string help,
                std::function<void(const std::string&)> set) {
  return Flag{name, value, std::move(help), std::move(set), {}, {}};
}

Flag switch_flag(const char* name, std::string help, std::function<void()> on) {
  return Flag{name, "", std::move(help), {}, std::move(on), {}};
}

Flag choice_flag(const char* name, const char* value, std::string help,
                 std::vector<std::string> choices, std::string refusal,
                 std::function<void(const std::string&)> set) {
  return value_flag(name, value, std::move(help),
                    [name, choices, refusal, set](const std::string& v) {
                      if (std::find(choices.begin(), choices.end(), v) == choices.end())
                        throw UsageError(strf("%s %s %s", name, v.c_str(), refusal.c_str()));
                      set(v);
                    });
}

Flag switch_flag(const char* name, std::string help, bool& target, bool value) {
  return switch_flag(name, std::move(help), [&target, value] { target = value; });
}

Flag moved_flag(const char* name, std::string message, std::string hint) {
  const auto moved = [message, hint](const std::string& next) {
    std::string m = message;
    const size_t at = m.find("{FILE}");
    if (at != std::string::npos)
      m.replace(at, 6, next.empty() || next[0] == '-' ? "FILE" : escape(next));
    throw UsageError(m, hint);
  };
  return Flag{name, "", "", {}, {}, moved};
}

namespace {

enum class Number { kOk, kMalformed, kTooLarge, kNegative };

// A whole number in decimal, or in hexadecimal after 0x; a '-' before one is
// kNegative (out of range, not malformed).
Number to_u64(const std::string& text, uint64_t* out) {
  const char* s = text.c_str();
  bool negative = false;
  if (*s == '-') {
    negative = true;
    ++s;
  }
  int base = 10;
  if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X') && s[2]) {
    s += 2;
    base = 16;
  }
  if (base == 10 ? !std::isdigit(static_cast<unsigned char>(*s))
                 : !std::isxdigit(static_cast<unsigned char>(*s)))
    return Number::kMalformed;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, base);
  if (*end != '\0') return Number::kMalformed;
  if (negative) return v == 0 && errno != ERANGE ? (*out = 0, Number::kOk) : Number::kNegative;
  if (errno == ERANGE) return Number::kTooLarge;
  *out = v;
  return Number::kOk;
}

std::string size_range_text(uint64_t min, uint64_t max) {
  return fmt_bytes(min) + ".." + fmt_bytes(max);
}

// Every dtype lwo_dtype_name knows.
std::vector<lwo_dtype_t> all_dtypes() {
  std::vector<lwo_dtype_t> out;
  for (int d = 0; d < 256; ++d) {
    auto dtype = static_cast<lwo_dtype_t>(d);
    if (std::strcmp(lwo_dtype_name(dtype), "unknown") == 0) break;
    out.push_back(dtype);
  }
  return out;
}

}  // namespace

std::string range_text(uint64_t min, uint64_t max) {
  return strf("%llu..%llu", static_cast<unsigned long long>(min),
              static_cast<unsigned long long>(max));
}

uint64_t parse_uint(const std::string& flag, const std::string& text, uint64_t min, uint64_t max) {
  uint64_t v = 0;
  Number n = to_u64(text, &v);
  if (n == Number::kMalformed)
    throw UsageError(strf("%s %s is not a whole number in %s", flag.c_str(), quoted(text).c_str(),
                          range_text(min, max).c_str()));
  if (n != Number::kOk || v < min || v > max)
    throw UsageError(strf("%s %s is not in %s", flag.c_str(), escape(text).c_str(),
                          range_text(min, max).c_str()));
  return v;
}

uint64_t parse_size(const std::string& flag, const std::string& text, uint64_t min, uint64_t max) {
  size_t n = text.find_first_not_of("-0123456789");
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
    throw UsageError(
        strf("%s %s is not a size (a whole number with an optional K, M or G suffix)",
             flag.c_str(), quoted(text).c_str()));
  bool overflow = parsed != Number::kOk || (v << shift) >> shift != v;
  v <<= shift;
  if (overflow || v < min || v > max)
    throw UsageError(strf("%s %s is not in %s", flag.c_str(), escape(text).c_str(),
                          size_range_text(min, max).c_str()));
  return v;
}

std::string parse_path(const std::string& flag, const std::string& text) {
  if (text.empty()) throw UsageError(strf("%s needs a file name", flag.c_str()));
  return text;
}

// --- the flags several commands share ----------------------------------------

Flag timing_flag(bool& timing) {
  return switch_flag("--timing", "create the ring with LWO_RING_TIMING (copy and wait times)",
                     timing);
}
Flag json_flag(std::string& path) {
  return value_flag("--json", "FILE", "also write the results as JSON to FILE",
                    [&path](const std::string& v) { path = parse_path("--json", v); });
}
Flag quiet_flag() {
  return switch_flag("--quiet", "no progress on stderr (results still print)",
                     [] { g_quiet = true; });
}

std::vector<Flag> joined(std::initializer_list<std::vector<Flag>> parts) {
  std::vector<Flag> out;
  for (const std::vector<Flag>& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<Flag> model_flags(ModelOptions& m, std::vector<Flag> more) {
  return joined({{uint_flag(kLayersFlag, m.layers), uint_flag(kRowsFlag, m.rows),
                  uint_flag(kColsFlag, m.cols), dtype_flag(m.dtype, all_dtypes())},
                 more});
}

Flag dtype_flag(lwo_dtype_t& dtype, const std::vector<lwo_dtype_t>& allowed) {
  std::string names;
  for (size_t i = 0; i < allowed.size(); ++i)
    names += std::string(i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") +
             lwo_dtype_name(allowed[i]);
  std::string help =
      strf("element type: %s (default %s)", names.c_str(), lwo_dtype_name(dtype));
  return value_flag("--dtype", "T", help, [&dtype, allowed, names](const std::string& v) {
    for (lwo_dtype_t d : allowed)
      if (v == lwo_dtype_name(d)) {
        dtype = d;
        return;
      }
    throw UsageError(strf("--dtype %s is not one of %s", quoted(v).c_str(), names.c_str()));
  });
}

namespace {
struct QuantSpelling {
  const char* name;
  lwo_quant_format_t format;
};
constexpr QuantSpelling kQuantSpellings[] = {{"fp8", LWO_QUANT_FP8_E4M3_CHANNEL},
                                             {"fp8-block", LWO_QUANT_FP8_E4M3_BLOCK128},
                                             {"int8", LWO_QUANT_INT8_CHANNEL},
                                             {"int4", LWO_QUANT_INT4_GROUP128}};
}  // namespace

const char* quant_flag_name(lwo_quant_format_t format) {
  for (const QuantSpelling& q : kQuantSpellings)
    if (q.format == format) return q.name;
  return "none";
}

Flag quant_flag(lwo_quant_format_t& format) {
  return value_flag(
      "--quant", "F",
      "weights quantized on load: fp8 (e4m3, a scale per output channel), fp8-block (e4m3, a "
      "scale per 128x128 block), int8 (a scale per output channel) or int4 (a scale per 128 "
      "elements of a row; cols a multiple of 128); default: none",
      [&format](const std::string& v) {
        for (const QuantSpelling& q : kQuantSpellings)
          if (v == q.name) {
            format = q.format;
            return;
          }
        throw UsageError(
            strf("--quant %s is not one of fp8, fp8-block, int8 or int4", quoted(v).c_str()));
      });
}

Flag pattern_flag(CkptSpec& spec) {
  return value_flag(
      "--pattern", "P",
      "layer names: a prefix with one {i} for the layer index, e.g. \"blocks.{i}.\"; repeat it "
      "for models with several stacks (the layers of the first pattern come first); default: "
      "the first of " + default_patterns_text() + " that maps a tensor",
      [&spec](const std::string& v) {
        if (v.empty())
          throw UsageError("--pattern needs a pattern such as \"blocks.{i}.\"");
        if (!spec.names_file.empty())
          throw UsageError("--pattern and --names exclude each other");
        spec.patterns.push_back(v);
      });
}

Flag names_flag(CkptSpec& spec) {
  return value_flag("--names", "FILE",
                    "the layers by name: one line of FILE per layer, its tensors' full names "
                    "separated by blanks (blank lines and lines starting with # are skipped)",
                    [&spec](const std::string& v) {
                      if (!spec.patterns.empty())
                        throw UsageError("--pattern and --names exclude each other");
                      spec.names_file = parse_path("--names", v);
                    });
}

// --- parsing --------------------------------------------------------------------

namespace {

// "lwo train and lwo stream": the other commands that have `name`.
std::string commands_with(const std::string& name) {
  std::vector<std::string> with;
  for (const Command* c : commands()) {
    if (c == g_running || !c->flags) continue;
    for (const Flag& f : c->flags())
      if (f.name == name && !f.hidden()) {
        with.push_back(std::string("lwo ") + c->name);
        break;
      }
  }
  std::string s;
  for (size_t i = 0; i < with.size(); ++i)
    s += (i == 0 ? "" : i + 1 == with.size() ? " and " : ", ") + with[i];
  return s;
}

}  // namespace

bool parse_flags(int argc, char** argv, const std::vector<Flag>& flags,
                 std::vector<std::string>* operands) {
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--")) break;
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      print_command_help(*g_running, g_out);
      return false;
    }
  }
  bool only_operands = false;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (!only_operands && arg == "--") {
      only_operands = true;
      continue;
    }
    if (only_operands || arg.size() < 2 || arg[0] != '-') {
      if (!operands) throw UsageError(strf("unexpected argument %s", quoted(arg).c_str()));
      operands->push_back(arg);
      continue;
    }
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
    if (it == flags.end()) {
      std::string with = commands_with(name);
      if (!with.empty())
        throw UsageError(strf("%s is not a flag of %s (%s %s it)", escape(name).c_str(),
                              prefix().c_str(), with.c_str(),
                              with.find(" and ") != std::string::npos ? "have" : "has"));
      throw UsageError(strf("unknown flag %s", escape(name).c_str()));
    }
    if (it->moved) {
      it->moved(inline_value ? value : i + 1 < argc ? argv[i + 1] : "");
      throw UsageError(strf("%s is not a flag of %s", it->name.c_str(), prefix().c_str()));
    }
    if (it->on) {
      if (inline_value) throw UsageError(strf("%s takes no value", it->name.c_str()));
      it->on();
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc)
        throw UsageError(strf("%s needs a value: %s %s", it->name.c_str(), it->name.c_str(),
                              it->value.c_str()));
      value = argv[++i];
    }
    it->set(value);
  }
  return true;
}

// --- formatting and output --------------------------------------------------

std::string version_text() {
  unsigned v = lwo_version();
  return strf("%u.%u.%u", v / 10000, v / 100 % 100, v % 100);
}

void print_model(const ModelOptions& m, uint64_t record, uint64_t total) {
  print_row("model", "%u layers x \"weight\" [%lld x %lld] %s: %s per record, %s in all", m.layers,
            static_cast<long long>(m.rows), static_cast<long long>(m.cols),
            lwo_dtype_name(m.dtype), fmt_bytes(record).c_str(), fmt_bytes(total).c_str());
}

void print_row(const char* label, const char* fmt, ...) {
  std::printf("%-10s ", label);
  va_list ap;
  va_start(ap, fmt);
  std::vprintf(fmt, ap);
  va_end(ap);
  std::printf("\n");
}

JsonFile::~JsonFile() {
  if (!f_) return;
  std::fclose(f_);
  // Only our temporary file is removed (never the path, never /dev/stdout).
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void JsonFile::open(const std::string& path) {
  if (path.empty()) return;
  path_ = target_ = path;
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    f_ = std::fopen(path.c_str(), "w");  // /dev/stdout, a pipe: in place
    if (!f_)
      fail(strf("cannot write the JSON file %s: %s", quoted(path).c_str(), std::strerror(errno)));
    return;
  }
  // A regular file, or a new one: a temporary file beside it (beside the
  // file a symlink leads to), renamed over it at commit().
  if (exists) {
    if (char* r = ::realpath(path.c_str(), nullptr)) {
      target_ = r;
      std::free(r);
    }
  }
  std::string templ = target_ + ".XXXXXX";
  int fd = ::mkstemp(&templ[0]);
  if (fd < 0)
    fail(strf("cannot write the JSON file %s: %s", quoted(path).c_str(), std::strerror(errno)));
  // The mode a plain create (or the file there now) would have.
  const mode_t mask = exists ? 0 : ::umask(0);
  if (!exists) ::umask(mask);
  const mode_t mode = exists ? st.st_mode & 07777 : 0666 & ~mask;
  if (::fchmod(fd, mode) != 0 || !(f_ = ::fdopen(fd, "w"))) {
    const int e = errno;
    ::close(fd);
    ::unlink(templ.c_str());
    fail(strf("cannot write the JSON file %s: %s", quoted(path).c_str(), std::strerror(e)));
  }
  temp_ = templ;
}

void JsonFile::write(const Json& doc) {
  if (!f_) return;
  const auto dump = [](const Json& v) {
    return v.dump(-1, ' ', false, Json::error_handler_t::replace);
  };
  std::string text = "{\n";
  size_t n = 0;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const Json& v = it.value();
    text += "  " + dump(it.key()) + ": ";
    if (v.is_array() && !v.empty() && v.front().is_object()) {
      text += "[\n";
      for (size_t i = 0; i < v.size(); ++i) text += dump(v[i]) + (i + 1 < v.size() ? ",\n" : "\n");
      text += "  ]";
    } else {
      text += dump(v);
    }
    text += ++n < doc.size() ? ",\n" : "\n";
  }
  text += "}\n";
  bool ok = std::fputs(text.c_str(), f_) >= 0 && !std::ferror(f_);
  ok = std::fclose(f_) == 0 && ok;
  f_ = nullptr;
  if (ok && !temp_.empty() && std::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int e = errno;
    ::unlink(temp_.c_str());
    fail(strf("cannot write the JSON file %s: %s", quoted(path_).c_str(), std::strerror(e)));
  }
  if (!ok) {
    if (!temp_.empty()) ::unlink(temp_.c_str());
    fail(strf("writing the JSON file %s failed", quoted(path_).c_str()));
  }
  std::fflush(g_out);  // the results first, where both go to one file
  progress("wrote %s", escape(path_).c_str());
}

std::string escape(const std::string& s) {
  std::string out;
  lwo::escape_into(s, s.size(), out);
  return out;
}

std::string quoted(const std::string& s, size_t max) {
  std::string out = "\"";
  size_t used = lwo::escape_into(s, max, out);
  out += '"';
  if (used < s.size()) out += strf("... (%zu bytes)", s.size());
  return out;
}

Json json_ring(const lwo_ring_info& ring, const lwo_ring_stats& s, bool timing) {
  Json j = {{"depth", ring.depth}, {"slot_bytes", ring.slot_bytes}, {"stages", s.n_stages},
            {"hits", s.n_hits},    {"copies", s.n_copies},          {"bytes_copied", s.bytes_copied}};
  if (timing) {
    j["copy_ms"] = s.copy_ms;
    j["wait_ms"] = s.wait_ms;
    j["copy_gbps"] = s.bandwidth_gbps;
  }
  return j;
}

void PassResults::take(const TimedPasses& t, lwo_ring* r) {
  static_cast<TimedPasses&>(*this) = t;
  stats = ring_stats(r);
}

std::string PassResults::pass_line(uint32_t p, uint32_t passes, double t) const {
  return strf("pass %u/%u: %.3f ms, %.2f GB/s, %.2f%% of the peak", p, passes, t, gbps(t),
              100 * share(t));
}

void PassResults::print(uint32_t passes, bool timing) const {
  print_row("ring", "depth %u, %u x %s slots%s; checksum kernel per layer on a consumer stream",
            ring.depth, ring.depth, fmt_bytes(ring.slot_bytes).c_str(),
            timing ? ", timing on" : "");
  print_row("passes", "%u timed after 1 warm-up", passes);
  print_row("time", "median %.3f ms, best %.3f ms per pass", median_ms, best_ms);
  print_row("bandwidth", "median %.2f GB/s, best %.2f GB/s, all passes %.2f GB/s", gbps(median_ms),
            gbps(best_ms), gbps(total_ms / passes));
  std::printf("%-10s median %.2f%%, best %.2f%% of the peak", "share", 100 * share(median_ms),
              100 * share(best_ms));
}

void PassResults::to_json(Json& j, uint32_t passes) const {
  j["peak"] = {{"gbps", peak_gbps}, {"ms", peak_ms}, {"repeats", kPeakRepeats}};
  j["pass_ms"] = ms;
  j["median_ms"] = median_ms;
  j["best_ms"] = best_ms;
  const double all = total_ms / passes;
  j["gbps"] = {{"median", gbps(median_ms)}, {"best", gbps(best_ms)}, {"all_passes", gbps(all)}};
  j["share_of_peak"] = {
      {"median", share(median_ms)}, {"best", share(best_ms)}, {"all_passes", share(all)}};
}

void print_ring_stats(const lwo_ring_stats& s, bool timing) {
  print_row("ring stats", "%llu stages, %llu hits, %llu copies, %s copied (warm-up included)%s",
            static_cast<unsigned long long>(s.n_stages), static_cast<unsigned long long>(s.n_hits),
            static_cast<unsigned long long>(s.n_copies), fmt_bytes(s.bytes_copied).c_str(),
            timing ? strf("; copies %.2f ms on the GPU (%.2f GB/s), consumers waited %.2f ms",
                          s.copy_ms, s.bandwidth_gbps, s.wait_ms).c_str()
                   : "");
}

// --- the program -------------------------------------------------------------

std::FILE* g_out = stdout;
std::FILE* g_err = stderr;

int run_program(int argc, char** argv, int (*body)(int argc, char** argv)) {
  int rc = kExitFailure;
  set_release_reporter(report_release);
  try {
    rc = body(argc, argv);
  } catch (const UsageError& e) {
    // One line and one hint line, whatever the message holds.
    std::string message = e.what();
    for (char& c : message)
      if (c == '\n' || c == '\r') c = ' ';
    print_stderr(strf("%s: %s\n%s\n", prefix().c_str(), message.c_str(),
                      e.hint.empty() ? default_hint().c_str() : e.hint.c_str()));
    return kExitUsage;
  } catch (const Failure&) {
    rc = kExitFailure;  // already printed
  } catch (const std::exception& e) {  // testkit::Error (a failed call or check), and the like
    print_stderr(strf("%s: %s\n", prefix().c_str(), e.what()));
    rc = kExitFailure;
  } catch (...) {
    print_stderr(strf("%s: unknown error\n", prefix().c_str()));
    rc = kExitFailure;
  }
  // Results that could not be written (a full disk, a closed pipe) are a
  // failure, not a success with nothing to show.
  if (std::fflush(g_out) != 0 || std::ferror(g_out)) {
    const int err = errno;
    print_stderr(strf("%s: cannot write the results to stdout: %s\n", prefix().c_str(),
                      std::strerror(err ? err : EIO)));
    if (rc == kExitOk) rc = kExitFailure;
  }
  return release_failures() && rc == 0 ? kExitFailure : rc;
}

}  // namespace cli
