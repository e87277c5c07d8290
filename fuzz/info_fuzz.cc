// lwo info fuzzer: the input is a checkpoint folder laid out as
// checkpoint_fuzz.cc's (fuzz.h, write_checkpoint_input: one .safetensors
// file, or an index and its shards cut at "@@@@"), listed by the lwo
// program's own `lwo info` in this process (info_file below, tools/info.cc)
// with --quiet --estimate (no device is touched). The input's last byte picks
// the mapping (the default patterns, or --pattern "{i}", "layers.{i}." or
// "h.{i}.") and whether --json writes a file too.
//
// The oracle, on every input:
//   - the exit status is one docs/CLI.md gives: 0, 1 (the file cannot be
//     read) or 2 (a pattern that does not fit it);
//   - 0: nothing on stderr; stdout is the listing, its first line
//     "checkpoint PATH: F file(s), N tensor(s), ..."; with --json the file is
//     one JSON object of lwo info with N tensors and F files;
//   - 1 or 2: nothing on stdout; stderr begins with "lwo info: " and is one
//     line (1), or the error and a hint line "run 'lwo ..." (2); never an
//     "internal:" error;
//   - stdout and stderr are valid UTF-8 with no control character but the
//     newline: no ESC, CR, NUL, DEL or C1 control from the file reaches the
//     terminal (names, metadata, shard paths and messages are escaped).
// A crash, a sanitizer report (ASan, leaks, UBSan), a hang or an exception
// out of info_file is a bug too.
//
// Built by scripts/fuzz in the LWO_FUZZ build (clang -fsanitize=fuzzer);
// without LWO_LIBFUZZER a plain program that lists each input file it is
// given (the seed corpus, fuzz/corpus_info, in the unit tests);
// LWO_INFO_FUZZ_TRACE=1 prints each input's exit status and first line.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "src/common/utf8.h"
#include "tools/cli.h"

namespace {

// What a FILE* wrote, as a string (open_memstream).
class Capture {
 public:
  Capture() : f_(::open_memstream(&buf_, &len_)) { FUZZ_CHECK(f_ != nullptr, "open_memstream"); }
  ~Capture() {
    if (f_) std::fclose(f_);
    std::free(buf_);
  }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  std::FILE* file() { return f_; }
  std::string text() {
    std::fclose(f_);
    f_ = nullptr;
    return std::string(buf_ ? buf_ : "", len_);
  }

 private:
  char* buf_ = nullptr;
  size_t len_ = 0;
  std::FILE* f_ = nullptr;
};

// Valid UTF-8, no C0 control but '\n', no DEL, no C1 control.
void check_terminal_safe(const std::string& s, const char* which) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      FUZZ_CHECK((c >= 0x20 && c != 0x7F) || c == '\n',
                 std::string(which) + ": control byte " + std::to_string(c) + " at " +
                     std::to_string(i) + ": " + s);
      ++i;
      continue;
    }
    const size_t n = lwo::utf8_len(s, i);
    FUZZ_CHECK(n != 0, std::string(which) + ": not UTF-8 at " + std::to_string(i) + ": " + s);
    FUZZ_CHECK(!lwo::is_c1(s, i, n), std::string(which) + ": a C1 control at " + std::to_string(i));
    i += n;
  }
}

// `lwo info FLAGS... -- FILE` in this process, as the program runs it: its
// listing goes to `out`, its messages and progress to `err` (where the
// program writes stdout and stderr; no bar is drawn), and it returns the
// program's exit status (kExitOk, kExitFailure: FILE cannot be read;
// kExitUsage: bad flags, or a pattern or names file that does not fit FILE).
// Each call starts with --quiet off.
int info_file(const std::string& file, const std::vector<std::string>& flags, std::FILE* out,
              std::FILE* err) {
  std::vector<std::string> args = {cli::g_program, cli::kInfoCommand.name};
  args.insert(args.end(), flags.begin(), flags.end());
  args.push_back("--");
  args.push_back(file);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(&a[0]);
  argv.push_back(nullptr);
  cli::g_quiet = false;
  cli::g_out = out;
  cli::g_err = err;
  const int rc = cli::run_program(static_cast<int>(args.size()), argv.data(), cli::dispatch);
  cli::g_out = stdout;
  cli::g_err = stderr;
  return rc;
}

size_t count_lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

void run_input(const uint8_t* data, size_t size) {
  const lwo_fuzz::CheckpointInput in = lwo_fuzz::write_checkpoint_input(data, size);
  const uint8_t pick = size ? data[size - 1] : 0;
  std::vector<std::string> flags = {"--quiet", "--estimate"};
  static const char* const kPatterns[] = {nullptr, "{i}", "layers.{i}.", "h.{i}."};
  if (const char* p = kPatterns[pick % 4]) {
    flags.push_back("--pattern");
    flags.push_back(p);
  }
  const std::string json_path = lwo_fuzz::folder() + "/info.json";
  ::unlink(json_path.c_str());
  const bool json = pick & 4;
  if (json) {
    flags.push_back("--json");
    flags.push_back(json_path);
  }

  Capture out, err;
  const int rc = info_file(in.path, flags, out.file(), err.file());
  const std::string o = out.text(), e = err.text();
  static const bool trace = std::getenv("LWO_INFO_FUZZ_TRACE") != nullptr;
  if (trace)
    std::printf("exit %d, flags %u: %s", rc, pick & 7u,
                (rc ? e : o.substr(0, o.find('\n') + 1)).c_str());

  FUZZ_CHECK(rc == cli::kExitOk || rc == cli::kExitFailure || rc == cli::kExitUsage,
             "exit status " + std::to_string(rc) + ": " + e);
  check_terminal_safe(o, "stdout");
  check_terminal_safe(e, "stderr");
  // The program's own "internal:" errors (the file's text may say it anywhere else).
  FUZZ_CHECK(e.compare(0, 19, "lwo info: internal:") != 0, e);
  if (rc != cli::kExitOk) {
    FUZZ_CHECK(o.empty(), "a failure printed a listing: " + o);
    FUZZ_CHECK(e.compare(0, 10, "lwo info: ") == 0, e);
    FUZZ_CHECK(!e.empty() && e.back() == '\n', e);
    if (rc == cli::kExitFailure) {
      FUZZ_CHECK(count_lines(e) == 1, "not one line: " + e);
    } else {
      FUZZ_CHECK(count_lines(e) == 2, "not an error and a hint line: " + e);
      FUZZ_CHECK(e.find("\nrun 'lwo ") != std::string::npos, e);
    }
    FUZZ_CHECK(::access(json_path.c_str(), F_OK) != 0, "a failure wrote the JSON file");
    return;
  }
  FUZZ_CHECK(e.empty(), "a success wrote to stderr: " + e);
  const std::string head = "checkpoint " + in.path + ": ";
  FUZZ_CHECK(o.compare(0, head.size(), head) == 0, o);
  unsigned long files = 0, tensors = 0;
  FUZZ_CHECK(
      std::sscanf(o.c_str() + head.size(), "%lu file%*[s], %lu tensor", &files, &tensors) == 2 ||
          std::sscanf(o.c_str() + head.size(), "%lu file, %lu tensor", &files, &tensors) == 2,
      o.substr(0, 200));
  FUZZ_CHECK(files >= 1, o.substr(0, 200));
  if (json) {
    std::string text;
    std::FILE* f = std::fopen(json_path.c_str(), "rb");
    FUZZ_CHECK(f != nullptr, "no JSON file");
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
    std::fclose(f);
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    FUZZ_CHECK(j.is_object(), "not a JSON object: " + text.substr(0, 200));
    FUZZ_CHECK(j.value("tool", "") == "lwo" && j.value("command", "") == "info",
               text.substr(0, 200));
    const auto listed = [&](const char* key, unsigned long n) {
      const auto it = j.find(key);
      return it != j.end() && it->is_array() && it->size() == n;
    };
    FUZZ_CHECK(listed("tensors", tensors) && listed("files", files), text.substr(0, 200));
  }
}

}  // namespace

LWO_FUZZ_ENTRY(run_input)

#ifndef LWO_LIBFUZZER
LWO_FUZZ_FILES_MAIN(run_input, "lwo_info_fuzz")
#endif
