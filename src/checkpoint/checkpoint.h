// A safetensors checkpoint opened for streaming: one file, or the shards named
// by a *.safetensors.index.json, each mapped read-only and shared (the page
// cache holds one copy per node however many processes map it).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "safetensors.h"

namespace lwo {

class Checkpoint {
 public:
  struct File {
    std::string path;
    int fd = -1;
    uint8_t* map = nullptr;
    uint64_t size = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    struct timespec mtime {};  // the modification time at open
    uint32_t n_tensors = 0;  // entries that lie in this file
  };
  struct Metadata {
    uint32_t file;
    std::string key, value;
  };
  // Tensors grouped into layers, with the prefix each layer's tensors lose
  // inside the layer ("" for explicit names).
  struct Mapping {
    st::LayerMap map;
    std::vector<std::string> strip;  // per layer
  };
  // For every entry: its layer under `m` (or kNoLayer) and its name inside
  // that layer (a pointer into the entry's name; null when unmatched).
  static constexpr uint32_t kNoLayer = 0xffffffffu;
  void tensor_layers(const Mapping& m, uint32_t* layers, const char** names) const;

  // Opens `path` (a .safetensors file or an index .json), maps every file and
  // validates every header. Throws LWO_ERR_IO and the format statuses.
  static std::shared_ptr<Checkpoint> open(const std::string& path);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::vector<File>& files() const { return files_; }
  const std::vector<st::Entry>& entries() const { return entries_; }
  const std::string& path() const { return path_; }
  // "__metadata__" of every file, file by file, key by key.
  const std::vector<Metadata>& metadata() const { return metadata_; }
  // The layer mappings of lwo_checkpoint_pool_config (see lwo.h). Throw
  // LWO_ERR_INVALID_ARGUMENT and LWO_ERR_NOT_FOUND as st::map_by_*.
  // Several patterns: the layers of patterns[0] first, then of patterns[1]
  // over the tensors left, and so on.
  Mapping map_by_patterns(const std::vector<std::string>& patterns, bool allow_gaps) const;
  Mapping map_by_names(const std::vector<std::vector<std::string>>& names) const;
  const uint8_t* bytes(const st::Entry& e) const { return files_[e.file].map + e.begin; }
  // Throws LWO_ERR_FILE_CHANGED if a file changed since it was opened: the
  // open file's size or modification time differs. A file replaced by a
  // rename is no change (the mapping keeps the old file).
  void check_unchanged() const;
  // The index of the entry called `name`, or -1 (names are unique).
  int64_t find(const std::string& name) const;

 private:
  Checkpoint() = default;
  void map_file(const std::string& path);
  // The first min(size, 8 + N) bytes of file `i` (its header), read with
  // pread rather than through the mapping: a file that shrinks meanwhile is
  // a short read (LWO_ERR_IO / LWO_ERR_TRUNCATED), not a SIGBUS.
  std::vector<uint8_t> read_header(size_t i) const;

  std::string path_;
  std::vector<File> files_;
  std::vector<st::Entry> entries_;
  std::vector<Metadata> metadata_;
  std::unordered_map<std::string, size_t> by_name_;  // entries_ by name
};

}  // namespace lwo
