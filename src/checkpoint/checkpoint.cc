#include "checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "src/common/error.h"

namespace lwo {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string dir_of(const std::string& p) {
  size_t i = p.find_last_of('/');
  return i == std::string::npos ? std::string(".") : p.substr(0, i);
}

}  // namespace

void Checkpoint::map_file(const std::string& path) {
  File f;
  f.path = path;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) fail(LWO_ERR_IO, "cannot open '%s': %s", path.c_str(), std::strerror(errno));
  struct stat st {};
  if (fstat(f.fd, &st) != 0) {
    int e = errno;
    ::close(f.fd);
    fail(LWO_ERR_IO, "cannot stat '%s': %s", path.c_str(), std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(f.fd);
    fail(LWO_ERR_IO, "'%s' is not a regular file", path.c_str());
  }
  f.size = static_cast<uint64_t>(st.st_size);
  f.dev = st.st_dev;
  f.ino = st.st_ino;
  if (f.size > 0) {
    void* m = mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      ::close(f.fd);
      fail(LWO_ERR_IO, "cannot map '%s' (%llu bytes): %s", path.c_str(),
           static_cast<unsigned long long>(f.size), std::strerror(e));
    }
    f.map = static_cast<uint8_t*>(m);
  }
  files_.push_back(f);
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& path) {
  std::shared_ptr<Checkpoint> ck(new Checkpoint());
  ck->path_ = path;
  if (ends_with(path, ".json")) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(LWO_ERR_IO, "cannot open '%s': %s", path.c_str(), std::strerror(errno));
    std::ostringstream ss;
    ss << in.rdbuf();
    std::map<std::string, std::string> wm = st::parse_index(ss.str(), path);
    std::map<std::string, uint32_t> file_index;
    for (const auto& kv : wm) {
      if (kv.second.find('/') != std::string::npos || kv.second == "." || kv.second == "..")
        fail(LWO_ERR_BAD_JSON, "%s: tensor '%s' names shard '%s' outside the index's folder",
             path.c_str(), kv.first.c_str(), kv.second.c_str());
      if (!file_index.count(kv.second)) {
        uint32_t i = static_cast<uint32_t>(ck->files_.size());
        file_index[kv.second] = i;
        ck->map_file(dir_of(path) + "/" + kv.second);
      }
    }
    // Every shard's tensors; every tensor the index names must be in its shard.
    for (const auto& fi : file_index) {
      const File& f = ck->files_[fi.second];
      std::vector<st::Entry> es = st::parse_header(f.map, f.size, f.path);
      std::set<std::string> here;
      for (st::Entry& e : es) {
        e.file = fi.second;
        here.insert(e.name);
        auto w = wm.find(e.name);
        if (w != wm.end() && w->second == fi.first) ck->entries_.push_back(e);
      }
      for (const auto& kv : wm)
        if (kv.second == fi.first && !here.count(kv.first))
          fail(LWO_ERR_NOT_FOUND, "%s: tensor '%s' is not in shard '%s'", path.c_str(),
               kv.first.c_str(), f.path.c_str());
    }
  } else {
    ck->map_file(path);
    const File& f = ck->files_[0];
    ck->entries_ = st::parse_header(f.map, f.size, f.path);
    for (st::Entry& e : ck->entries_) e.file = 0;
  }
  return ck;
}

Checkpoint::~Checkpoint() {
  for (File& f : files_) {
    if (f.map) munmap(f.map, f.size);
    if (f.fd >= 0) ::close(f.fd);
  }
}

void Checkpoint::check_unchanged(const char* call) const {
  for (const File& f : files_) {
    struct stat st {};
    if (fstat(f.fd, &st) != 0)
      fail(LWO_ERR_IO, "%s: cannot stat '%s': %s", call, f.path.c_str(), std::strerror(errno));
    if (static_cast<uint64_t>(st.st_size) != f.size)
      fail(LWO_ERR_FILE_CHANGED, "%s: '%s' changed size since it was opened (%llu bytes, now %llu)",
           call, f.path.c_str(), static_cast<unsigned long long>(f.size),
           static_cast<unsigned long long>(st.st_size));
  }
}

}  // namespace lwo
