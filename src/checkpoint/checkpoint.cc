#include "checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "src/common/error.h"

namespace lwo {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string dir_of(const std::string& p) {
  size_t i = p.find_last_of('/');
  return i == std::string::npos ? std::string(".") : i == 0 ? std::string("/") : p.substr(0, i);
}

// A file or tensor name as the messages show it: in single quotes, escaped
// (a name from a file or an index cannot put an escape sequence or a line on
// the caller's terminal).
std::string q(const std::string& s) { return st::printable(s, '\''); }

}  // namespace

namespace {

// Opens a regular file read-only. O_NONBLOCK keeps a named pipe (or a device)
// from blocking the open; it is refused right after, as is a folder.
int open_regular(const std::string& path, struct stat* st) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(LWO_ERR_IO, "cannot open %s: %s", q(path).c_str(), std::strerror(errno));
  if (fstat(fd, st) != 0) {
    int e = errno;
    ::close(fd);
    fail(LWO_ERR_IO, "cannot stat %s: %s", q(path).c_str(), std::strerror(e));
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    const char* what = S_ISDIR(st->st_mode)    ? "a folder"
                       : S_ISFIFO(st->st_mode) ? "a named pipe"
                       : S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) ? "a device"
                       : S_ISSOCK(st->st_mode) ? "a socket"
                                               : "not a regular file";
    fail(LWO_ERR_IO, "%s is %s, not a regular file", q(path).c_str(), what);
  }
  return fd;
}

// The absolute path of `path` with every symlink resolved.
std::string real_path(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (!r) fail(LWO_ERR_IO, "cannot resolve %s: %s", q(path).c_str(), std::strerror(errno));
  std::string out(r);
  std::free(r);
  return out;
}

// The whole text of a regular file (an index), refused from its size before
// any of it is read when it is above st::kMaxIndexBytes.
std::string read_text(const std::string& path) {
  struct stat st {};
  int fd = open_regular(path, &st);
  if (static_cast<uint64_t>(st.st_size) > st::kMaxIndexBytes) {
    ::close(fd);
    fail(LWO_ERR_BAD_HEADER_SIZE, "index %s is %llu bytes, above the limit of %llu for an index",
         q(path).c_str(), static_cast<unsigned long long>(st.st_size),
         static_cast<unsigned long long>(st::kMaxIndexBytes));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    ssize_t n = ::read(fd, &text[got], text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      fail(LWO_ERR_IO, "cannot read %s: %s", q(path).c_str(), n < 0 ? std::strerror(e) : "cut short");
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return text;
}

}  // namespace

void Checkpoint::map_file(const std::string& path) {
  File f;
  f.path = path;
  struct stat st {};
  f.fd = open_regular(path, &st);
  f.size = static_cast<uint64_t>(st.st_size);
  f.dev = st.st_dev;
  f.ino = st.st_ino;
  f.mtime = st.st_mtim;
  if (f.size > 0) {
    void* m = mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      ::close(f.fd);
      fail(LWO_ERR_IO, "cannot map %s (%llu bytes): %s", q(path).c_str(),
           static_cast<unsigned long long>(f.size), std::strerror(e));
    }
    f.map = static_cast<uint8_t*>(m);
  }
  files_.push_back(f);
}

std::vector<uint8_t> Checkpoint::read_header(size_t i) const {
  const File& f = files_[i];
  auto read_at = [&](uint8_t* to, size_t n, uint64_t at) {
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::pread(f.fd, to + got, n - got, static_cast<off_t>(at + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        fail(LWO_ERR_IO, "cannot read %s: %s", q(f.path).c_str(), std::strerror(errno));
      if (r == 0)
        fail(LWO_ERR_TRUNCATED, "%s: the file ends at byte %llu of its header (%llu bytes at open: "
             "cut short while it was opened?)", q(f.path).c_str(),
             static_cast<unsigned long long>(at + got), static_cast<unsigned long long>(f.size));
      got += static_cast<size_t>(r);
    }
  };
  std::vector<uint8_t> head(static_cast<size_t>(std::min<uint64_t>(f.size, 8)));
  read_at(head.data(), head.size(), 0);
  if (head.size() < 8) return head;  // parse_header says it is too short
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | head[k];
  // A length parse_header refuses needs no more bytes.
  if (n == 0 || n > st::kMaxHeaderBytes || n > f.size - 8) return head;
  head.resize(static_cast<size_t>(8 + n));
  read_at(head.data() + 8, static_cast<size_t>(n), 8);
  return head;
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& path) {
  std::shared_ptr<Checkpoint> ck(new Checkpoint());
  ck->path_ = path;
  if (ends_with(path, ".json")) {
    std::map<std::string, std::string> wm = st::parse_index(read_text(path), q(path));
    if (wm.empty())
      fail(LWO_ERR_BAD_JSON, "%s: the index's weight_map names no tensor (a checkpoint of no files)",
           q(path).c_str());
    std::map<std::string, uint32_t> file_index;  // shard name -> file, in name order
    for (const auto& kv : wm) {
      if (kv.second.find('/') != std::string::npos || kv.second == "." || kv.second == "..")
        fail(LWO_ERR_BAD_JSON, "%s: tensor %s names shard %s outside the index's folder",
             q(path).c_str(), q(kv.first).c_str(), q(kv.second).c_str());
      file_index[kv.second] = 0;
    }
    // The name checks are lexical; a shard may still be a symlink that leads
    // out of the folder. Its real path must lie directly in the index's folder:
    // the folder it is named from, or the folder the index really lies in (a
    // hub cache links both the index and its shards to one blob folder).
    const std::string folder = real_path(dir_of(path));
    const std::string index_folder = dir_of(real_path(path));
    for (auto& fi : file_index) {
      fi.second = static_cast<uint32_t>(ck->files_.size());
      const std::string shard = dir_of(path) + "/" + fi.first;
      ck->map_file(shard);
      const std::string real = real_path(shard);
      const std::string real_folder = dir_of(real);
      if (real_folder != folder && real_folder != index_folder)
        fail(LWO_ERR_BAD_JSON,
             "%s: shard %s lies outside the index's folder %s: its real path is %s",
             q(path).c_str(), q(shard).c_str(), q(index_folder).c_str(), q(real).c_str());
      // The file opened is the one checked (not one swapped in between).
      struct stat st {};
      const File& f = ck->files_.back();
      if (::stat(real.c_str(), &st) != 0 || st.st_dev != f.dev || st.st_ino != f.ino)
        fail(LWO_ERR_FILE_CHANGED, "%s: shard %s changed while it was opened", q(path).c_str(),
             q(shard).c_str());
    }
    // Every shard's tensors; every tensor the index names must be in its shard.
    for (const auto& fi : file_index) {
      const File& f = ck->files_[fi.second];
      std::map<std::string, std::string> meta;
      const std::vector<uint8_t> head = ck->read_header(fi.second);
      std::vector<st::Entry> es = st::parse_header(head.data(), f.size, q(f.path), &meta);
      for (const auto& kv : meta) ck->metadata_.push_back({fi.second, kv.first, kv.second});
      std::set<std::string> here;
      for (st::Entry& e : es) {
        e.file = fi.second;
        here.insert(e.name);
        auto w = wm.find(e.name);
        if (w != wm.end() && w->second == fi.first) ck->entries_.push_back(e);
      }
      for (const auto& kv : wm)
        if (kv.second == fi.first && !here.count(kv.first))
          fail(LWO_ERR_BAD_JSON, "%s: tensor %s is not in shard %s", q(path).c_str(),
               q(kv.first).c_str(), q(f.path).c_str());
    }
  } else {
    ck->map_file(path);
    const File& f = ck->files_[0];
    std::map<std::string, std::string> meta;
    const std::vector<uint8_t> head = ck->read_header(0);
    ck->entries_ = st::parse_header(head.empty() ? nullptr : head.data(), f.size, q(f.path), &meta);
    for (st::Entry& e : ck->entries_) e.file = 0;
    for (const auto& kv : meta) ck->metadata_.push_back({0, kv.first, kv.second});
  }
  for (const st::Entry& e : ck->entries_) ++ck->files_[e.file].n_tensors;
  for (size_t i = 0; i < ck->entries_.size(); ++i) ck->by_name_.emplace(ck->entries_[i].name, i);
  return ck;
}

int64_t Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : static_cast<int64_t>(it->second);
}

Checkpoint::~Checkpoint() {
  for (File& f : files_) {
    if (f.map) munmap(f.map, f.size);
    if (f.fd >= 0) ::close(f.fd);
  }
}

void Checkpoint::check_unchanged() const {
  for (const File& f : files_) {
    struct stat st {};
    if (fstat(f.fd, &st) != 0)
      fail(LWO_ERR_IO, "cannot stat %s: %s", q(f.path).c_str(), std::strerror(errno));
    if (static_cast<uint64_t>(st.st_size) != f.size)
      fail(LWO_ERR_FILE_CHANGED, "%s changed size since it was opened (%llu bytes, now %llu)",
           q(f.path).c_str(), static_cast<unsigned long long>(f.size),
           static_cast<unsigned long long>(st.st_size));
    if (st.st_mtim.tv_sec != f.mtime.tv_sec || st.st_mtim.tv_nsec != f.mtime.tv_nsec)
      fail(LWO_ERR_FILE_CHANGED, "%s was modified since it was opened (its modification time "
           "changed)", q(f.path).c_str());
    // The device and inode of the open file cannot change; a file replaced
    // by a rename is no change (the mapping keeps the old inode and its
    // contents, the documented way to update a checkpoint).
  }
}

Checkpoint::Mapping Checkpoint::map_by_patterns(const std::vector<std::string>& patterns,
                                                bool allow_gaps) const {
  if (patterns.empty()) fail(LWO_ERR_INVALID_ARGUMENT, "no pattern given");
  Mapping m;
  std::vector<size_t> left(entries_.size());  // entries no earlier pattern took
  for (size_t i = 0; i < left.size(); ++i) left[i] = i;
  for (const std::string& pattern : patterns) {
    size_t at = pattern.find("{i}");
    if (at == std::string::npos || pattern.find("{i}", at + 1) != std::string::npos)
      fail(LWO_ERR_INVALID_ARGUMENT, "pattern %s must contain \"{i}\" once", q(pattern).c_str());
    std::vector<st::Entry> sub;
    sub.reserve(left.size());
    for (size_t i : left) sub.push_back(entries_[i]);
    st::LayerMap pm = st::map_by_pattern(sub, pattern, q(path_), allow_gaps);
    if (m.map.layers.size() + pm.layers.size() > st::kMaxLayers)
      fail(LWO_ERR_BAD_RANGE,
           "%s: the patterns make %zu layers with %s's %zu, beyond the %llu layers a mapping "
           "may make",
           q(path_).c_str(), m.map.layers.size() + pm.layers.size(), q(pattern).c_str(),
           pm.layers.size(), static_cast<unsigned long long>(st::kMaxLayers));
    // Within layer l of this pattern a tensor is named without its prefix.
    for (size_t l = 0; l < pm.layers.size(); ++l) {
      std::vector<size_t> layer;
      for (size_t k : pm.layers[l]) layer.push_back(left[k]);
      m.map.layers.push_back(std::move(layer));
      m.strip.push_back(pattern.substr(0, at) + std::to_string(l) + pattern.substr(at + 3));
    }
    std::vector<size_t> still;
    for (size_t k : pm.unmatched) still.push_back(left[k]);
    left.swap(still);
  }
  m.map.unmatched = left;
  return m;
}

void Checkpoint::tensor_layers(const Mapping& m, uint32_t* layers, const char** names) const {
  for (size_t i = 0; i < entries_.size(); ++i) {
    layers[i] = kNoLayer;
    if (names) names[i] = nullptr;
  }
  for (size_t l = 0; l < m.map.layers.size(); ++l)
    for (size_t k : m.map.layers[l]) {
      layers[k] = static_cast<uint32_t>(l);
      // Within its layer a tensor is named without the layer's prefix.
      if (names) names[k] = entries_[k].name.c_str() + m.strip[l].size();
    }
}

Checkpoint::Mapping Checkpoint::map_by_names(
    const std::vector<std::vector<std::string>>& names) const {
  Mapping m;
  m.map = st::map_by_names(entries_, names, q(path_));
  m.strip.assign(names.size(), std::string());
  return m;
}

}  // namespace lwo
