// What the fuzzers (fuzz/*_fuzz.cc) share: the check that aborts on a broken
// promise, libFuzzer's entry point over a fuzzer's run_input, and the plain
// program's reading of an input file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace lwo_fuzz {

[[noreturn]] inline void broken(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: broken promise: %s\n", file, line, what.c_str());
  std::abort();
}

// Runs run_input over the bytes of the file f.
inline void run_file(const std::string& f, void (*run_input)(const uint8_t*, size_t)) {
  std::ifstream in(f, std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  run_input(b.data(), b.size());
}

}  // namespace lwo_fuzz

// Aborts with the condition and what (a string, or strings joined with +)
// where cond does not hold.
#define FUZZ_CHECK(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) lwo_fuzz::broken(__FILE__, __LINE__, std::string(#cond) + " " + __VA_ARGS__); \
  } while (0)

// libFuzzer's entry point: each input goes to run_input(data, size).
#define LWO_FUZZ_ENTRY(run_input)                                         \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    run_input(data, size);                                                \
    return 0;                                                             \
  }
