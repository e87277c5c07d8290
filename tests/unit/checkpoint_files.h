// Safetensors files for the unit tests: tensors of random bytes, written
// with an optional "__metadata__", in a temporary folder that is removed with
// the fixture.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace lwo {
namespace testing {

struct FileTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  size_t elem;
  std::vector<uint8_t> bytes;
};

inline FileTensor make_tensor(const std::string& name, const std::string& dt, size_t elem,
                              std::vector<int64_t> shape, uint64_t seed) {
  FileTensor t{name, dt, shape, elem, {}};
  size_t n = elem;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  t.bytes.resize(n);
  fill_random(t.bytes.data(), n, seed);
  return t;
}

// Writes text to the file at path (opened with mode: std::ios::app appends).
inline void write_text(const std::string& path, const std::string& text,
                       std::ios::openmode mode = std::ios::out) {
  std::ofstream out(path, mode);
  out << text;
}

// Writes a safetensors file: an optional "__metadata__" (keys in the order
// given), the tensors' header entries and their data, packed in the given
// order. Returns the absolute file offset of each tensor's data.
inline std::vector<uint64_t> write_safetensors(
    const std::string& path, const std::vector<FileTensor>& ts,
    const std::vector<std::pair<std::string, std::string>>& meta = {}) {
  std::string h = "{";
  if (!meta.empty()) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < meta.size(); ++i)
      h += (i ? "," : "") + std::string("\"") + meta[i].first + "\":\"" + meta[i].second + "\"";
    h += "}";
  }
  uint64_t off = 0;
  std::vector<uint64_t> begins;
  for (size_t i = 0; i < ts.size(); ++i) {
    const FileTensor& t = ts[i];
    std::string shape;
    for (size_t d = 0; d < t.shape.size(); ++d) shape += (d ? "," : "") + std::to_string(t.shape[d]);
    h += (i || !meta.empty() ? "," : "") + std::string("\"") + t.name + "\":{\"dtype\":\"" +
         t.dtype + "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(off) + "," +
         std::to_string(off + t.bytes.size()) + "]}";
    begins.push_back(off);
    off += t.bytes.size();
  }
  h += "}";
  while (h.size() % 8) h += ' ';
  uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const FileTensor& t : ts)
    out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  for (auto& b : begins) b += 8 + n;
  return begins;
}

// "embed" (in no layer), then for each of L layers "blocks.<i>.weight"
// [rows, 24] bf16 and "blocks.<i>.bias" [rows] f32.
inline std::vector<FileTensor> test_model(uint32_t L, uint64_t seed) {
  std::vector<FileTensor> ts;
  ts.push_back(make_tensor("embed", "F32", 4, {10, 3}, seed));
  for (uint32_t i = 0; i < L; ++i) {
    int64_t rows = 16 + 8 * (i % 3);
    ts.push_back(make_tensor("blocks." + std::to_string(i) + ".weight", "BF16", 2, {rows, 24}, seed + 2 * i + 1));
    ts.push_back(make_tensor("blocks." + std::to_string(i) + ".bias", "F32", 4, {rows}, seed + 2 * i + 2));
  }
  return ts;
}

// A temporary folder and the files made in it, removed on destruction.
class TempFiles {
 public:
  TempFiles() {
    char tmpl[] = "/tmp/lwo_unit_XXXXXX";
    if (mkdtemp(tmpl)) dir_ = tmpl;
  }
  ~TempFiles() {
    for (const std::string& f : written_) std::remove(f.c_str());
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  TempFiles(const TempFiles&) = delete;
  TempFiles& operator=(const TempFiles&) = delete;
  const std::string& dir() const { return dir_; }
  std::string file(const std::string& name) {
    written_.push_back(dir_ + "/" + name);
    return written_.back();
  }

 private:
  std::string dir_;
  std::vector<std::string> written_;
};

// The fixture Base with a temporary folder (dir) for the test's files.
template <class Base>
class WithFiles : public Base {
 protected:
  void SetUp() override {
    Base::SetUp();
    ASSERT_FALSE(tmp.dir().empty());
    dir = tmp.dir();
  }
  std::string file(const std::string& name) { return tmp.file(name); }
  std::vector<FileTensor> model(uint32_t L, uint64_t seed) { return test_model(L, seed); }
  TempFiles tmp;
  std::string dir;
};

}  // namespace testing
}  // namespace lwo
