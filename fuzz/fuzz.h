// What the fuzzers (fuzz/*_fuzz.cc) share: the check that aborts on a broken
// promise, libFuzzer's entry point over a fuzzer's run_input, the plain
// program's reading of an input file and of a seed folder, and the layout of
// an input as a checkpoint folder (checkpoint_fuzz.cc and info_fuzz.cc).
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// Runs run_input over each file given, or each file of each folder given (in
// name order); returns how many.
inline size_t run_files(int argc, char** argv, void (*run_input)(const uint8_t*, size_t)) {
  size_t n = 0;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> files;
    if (DIR* d = ::opendir(argv[i])) {
      while (dirent* e = ::readdir(d))
        if (e->d_name[0] != '.') files.push_back(std::string(argv[i]) + "/" + e->d_name);
      ::closedir(d);
      std::sort(files.begin(), files.end());
    } else {
      files.push_back(argv[i]);
    }
    for (const std::string& f : files) run_file(f, run_input);
    n += files.size();
  }
  return n;
}

// --- an input as a checkpoint folder ------------------------------------------
//
// An input that starts with '{' is an index folder: the input is cut at each
// "@@@@" into model.safetensors.index.json and the shards a.safetensors ..
// d.safetensors (the pieces past the fourth stay in d), beside in.safetensors
// (a symlink to a.safetensors, inside the folder) and out.safetensors (a
// symlink to a file outside it); the index is what is opened. Any other input
// is one model.safetensors, opened as a file.

constexpr const char* kShards[] = {"a.safetensors", "b.safetensors", "c.safetensors",
                                   "d.safetensors"};

// The folder, made once per process under /tmp (never freed: the exit
// handler that removes it runs after static objects are gone).
inline const std::string& folder() {
  static const std::string* const dir = new std::string([] {
    char tmpl[] = "/tmp/lwo-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl)) broken(__FILE__, __LINE__, "mkdtemp");
    std::string d = tmpl;
    if (::mkdir((d + "/in").c_str(), 0700) != 0 || ::mkdir((d + "/outside").c_str(), 0700) != 0)
      broken(__FILE__, __LINE__, "mkdir");
    std::ofstream(d + "/outside/x.safetensors", std::ios::binary) << std::string(8, '\0');
    if (::symlink("a.safetensors", (d + "/in/in.safetensors").c_str()) != 0 ||
        ::symlink((d + "/outside/x.safetensors").c_str(), (d + "/in/out.safetensors").c_str()) != 0)
      broken(__FILE__, __LINE__, "symlink");
    std::atexit([] {
      const std::string root = folder().substr(0, folder().size() - 3);
      DIR* in = ::opendir(folder().c_str());
      while (dirent* e = in ? ::readdir(in) : nullptr)
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
          ::unlink((folder() + "/" + e->d_name).c_str());
      if (in) ::closedir(in);
      ::unlink((root + "/outside/x.safetensors").c_str());
      ::rmdir(folder().c_str());
      ::rmdir((root + "/outside").c_str());
      ::rmdir(root.c_str());
    });
    return d + "/in";
  }());
  return *dir;
}

inline void write_file(const std::string& path, const uint8_t* p, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(p), static_cast<std::streamsize>(n));
  if (!f.good()) broken(__FILE__, __LINE__, "cannot write " + path);
}

// The input written into folder(): the path to open, and for an index
// folder the index text.
struct CheckpointInput {
  std::string path;
  bool is_index = false;
  std::string index_text;
};

inline CheckpointInput write_checkpoint_input(const uint8_t* data, size_t size) {
  const std::string& dir = folder();
  for (const char* s : kShards) ::unlink((dir + "/" + s).c_str());
  CheckpointInput in;
  if (size == 0 || data[0] != '{') {
    in.path = dir + "/model.safetensors";
    write_file(in.path, data, size);
    return in;
  }
  // Cut at "@@@@": the index text, then the shards.
  std::vector<std::pair<size_t, size_t>> parts;
  size_t from = 0;
  for (size_t i = 0; i + 4 <= size && parts.size() < 4;) {
    if (std::memcmp(data + i, "@@@@", 4) == 0) {
      parts.push_back({from, i});
      from = i = i + 4;
    } else {
      ++i;
    }
  }
  parts.push_back({from, size});
  in.path = dir + "/model.safetensors.index.json";
  in.is_index = true;
  in.index_text.assign(reinterpret_cast<const char*>(data + parts[0].first),
                       parts[0].second - parts[0].first);
  write_file(in.path, data + parts[0].first, parts[0].second - parts[0].first);
  for (size_t k = 1; k < parts.size(); ++k)
    write_file(dir + "/" + kShards[k - 1], data + parts[k].first, parts[k].second - parts[k].first);
  return in;
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

// The plain program of a fuzzer over files (no libFuzzer): run_input over
// each input file given, or each file of each folder given, then a line
// naming the program and the count.
#define LWO_FUZZ_FILES_MAIN(run_input, program)                      \
  int main(int argc, char** argv) {                                  \
    const size_t n = lwo_fuzz::run_files(argc, argv, run_input);     \
    std::printf("%s: %zu inputs, no failure\n", program, n);         \
    return 0;                                                        \
  }
