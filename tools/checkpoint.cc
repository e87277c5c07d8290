// Checkpoint helpers shared by lwo info and lwo stream: opening a safetensors
// checkpoint, reading its files, metadata and tensor list, reading a names
// file, and mapping tensors to layers by name patterns (given, or the first
// default that maps a tensor) or by explicit names.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace cli {

const char* const kDefaultPatterns[] = {"model.layers.{i}.", "blocks.{i}.", "layers.{i}.", "h.{i}.",
                                        "transformer.h.{i}."};

std::string default_patterns_text() {
  std::string s;
  for (const char* p : kDefaultPatterns)
    s += (s.empty() ? "\"" : ", \"") + std::string(p) + "\"";
  return s;
}

std::string CkptTensor::lwo_dtype() const {
  if (dtype < 0) return dtype_name + "?";
  return lwo_dtype_name(static_cast<lwo_dtype_t>(dtype));
}

namespace {

// What a file that is not a regular file is, for the message.
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a named pipe";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string base_name(const std::string& path) {
  size_t i = path.find_last_of('/');
  return i == std::string::npos ? path : path.substr(i + 1);
}

// Reads --names FILE: one layer per line, its tensors' full names separated
// by blanks; blank lines and lines whose first non-blank is '#' are skipped.
// Refuses anything that is not a regular file without blocking.
std::vector<std::vector<std::string>> read_names_file(const std::string& path) {
  constexpr off_t kMaxBytes = off_t(64) << 20;
  // O_NONBLOCK: opening a named pipe returns at once; fstat then refuses it.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    fail(strf("--names %s: cannot open it: %s", quoted(path).c_str(), std::strerror(errno)));
  struct stat st {};
  std::string text;
  std::string error;
  if (fstat(fd, &st) != 0)
    error = strf("cannot stat it: %s", std::strerror(errno));
  else if (!S_ISREG(st.st_mode))
    error = strf("it is %s, not a regular file", kind_of(st.st_mode));
  else if (st.st_size > kMaxBytes)
    error = strf("it is %s, more than a names file of %s can be", fmt_bytes(st.st_size).c_str(),
                 fmt_bytes(kMaxBytes).c_str());
  else {
    text.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      ssize_t n = ::read(fd, &text[got], text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n < 0) error = strf("cannot read it: %s", std::strerror(errno));
        break;
      }
      got += static_cast<size_t>(n);
    }
    text.resize(got);
  }
  ::close(fd);
  if (!error.empty()) fail(strf("--names %s: %s", quoted(path).c_str(), error.c_str()));

  std::vector<std::vector<std::string>> layers;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    size_t first = line.find_first_not_of(" \t\r\f\v");
    if (first == std::string::npos || line[first] == '#') continue;
    // The names: the words between blanks (the line holds no '\n').
    std::istringstream words(line);
    layers.emplace_back(std::istream_iterator<std::string>(words),
                        std::istream_iterator<std::string>());
  }
  if (layers.empty())
    throw UsageError(strf("--names %s names no tensor: give one line of names per layer",
                          quoted(path).c_str()));
  return layers;
}

}  // namespace

bool parse_checkpoint_args(int argc, char** argv, const std::vector<Flag>& flags,
                           std::vector<std::string>* paths) {
  if (!parse_flags(argc, argv, flags, paths)) return false;
  if (paths->empty())
    throw UsageError("a checkpoint FILE is needed (a .safetensors or .safetensors.index.json file)");
  return true;
}

namespace {

// The items of a checkpoint listing: `count` (checked as `count_call`) says
// how many; read(i, item) fills each.
template <class T, class Read>
std::vector<T> listing(lwo_checkpoint* checkpoint,
                       lwo_status_t (*count)(const lwo_checkpoint*, uint32_t*),
                       const char* count_call, Read read) {
  uint32_t n = 0;
  check(count(checkpoint, &n), count_call);
  std::vector<T> out(n);
  for (uint32_t i = 0; i < n; ++i) read(i, out[i]);
  return out;
}

}  // namespace

void open_checkpoint(const std::string& path, Checkpoint& ck, CkptListing* out) {
  // Nothing here opens or reads `path` first: the library refuses what is
  // not a regular file (a folder, a named pipe, a device; shards of an index
  // too) without blocking, LWO_ERR_IO.
  lwo_status_t s = lwo_checkpoint_open(path.c_str(), ck.out());
  if (s != LWO_OK) fail(strf("%s (%s)", lwo_last_error_message(), lwo_status_string(s)));
  lwo_checkpoint* checkpoint = ck.get();
  out->path = path;
  out->files = listing<CkptFile>(
      checkpoint, lwo_checkpoint_file_count, "lwo_checkpoint_file_count(checkpoint, &n)",
      [&](uint32_t i, CkptFile& f) {
        lwo_checkpoint_file info = LWO_CHECKPOINT_FILE_INIT;
        TK_CHECK(lwo_checkpoint_file_info(checkpoint, i, &info));
        const std::string file = info.path ? info.path : "";
        f = CkptFile{file, base_name(file), info.bytes, info.n_tensors};
      });
  out->metadata = listing<CkptMeta>(
      checkpoint, lwo_checkpoint_metadata_count, "lwo_checkpoint_metadata_count(checkpoint, &n)",
      [&](uint32_t i, CkptMeta& m) {
        const char* key = nullptr;
        const char* value = nullptr;
        TK_CHECK(lwo_checkpoint_metadata(checkpoint, i, &m.file, &key, &value));
        m.key = key ? key : "";
        m.value = value ? value : "";
      });
  out->tensors = listing<CkptTensor>(
      checkpoint, lwo_checkpoint_tensor_count, "lwo_checkpoint_tensor_count(checkpoint, &n)",
      [&](uint32_t i, CkptTensor& t) {
        lwo_checkpoint_tensor info = LWO_CHECKPOINT_TENSOR_INIT;
        TK_CHECK(lwo_checkpoint_tensor_info(checkpoint, i, &info));
        t.name = info.name ? info.name : "";
        t.dtype_name = info.dtype_name ? info.dtype_name : "?";
        t.dtype = info.dtype;
        t.n_dims = info.n_dims;
        t.shape.assign(info.shape,
                       info.shape + std::min<int32_t>(std::max(info.n_dims, 0), LWO_MAX_DIMS));
        t.bytes = info.bytes;
        t.offset = info.file_offset;
        t.file = info.file;
        t.quant_format = info.quant_format;
        t.quant_partner = info.quant_partner;
      });
}

std::string CkptMap::describe() const {
  if (!names_file.empty()) return "the names in " + quoted(names_file);
  std::string s = patterns.size() == 1 ? "the pattern " : "the patterns ";
  for (size_t i = 0; i < patterns.size(); ++i) s += (i ? ", " : "") + quoted(patterns[i]);
  if (is_default) s += " (the first default that maps a tensor)";
  return s;
}

Json json_mapping(const CkptMap& m) {
  if (!m.names_file.empty()) return {{"names_file", m.names_file}, {"patterns", nullptr}};
  return {{"names_file", nullptr},
          {"patterns", m.patterns},
          {"pattern_source", m.is_default ? "default" : "given"}};
}

namespace {

// The layer index `name` has under `pattern` (text before "{i}", a decimal
// index without leading zeros, the text after), as lwo documents the rule;
// -1 if it does not match.
// Only to choose a default pattern (one that maps any tensor); which layer a
// tensor is in, the library says (lwo_checkpoint_map_tensors).
int64_t layer_of(const std::string& name, const std::string& pattern) {
  size_t at = pattern.find("{i}");
  if (at == std::string::npos) return -1;
  const std::string before = pattern.substr(0, at), after = pattern.substr(at + 3);
  if (name.compare(0, before.size(), before) != 0) return -1;
  size_t b = before.size(), e = b;
  while (e < name.size() && std::isdigit(static_cast<unsigned char>(name[e]))) ++e;
  if (e == b || (name[b] == '0' && e - b > 1) || e - b > 9) return -1;
  if (name.compare(e, after.size(), after) != 0) return -1;
  return std::stoll(name.substr(b, e - b));
}

bool maps_any(const std::vector<CkptTensor>& tensors, const std::string& pattern) {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const CkptTensor& t) { return layer_of(t.name, pattern) >= 0; });
}

}  // namespace

lwo_checkpoint_pool_config checkpoint_pool_config(CkptMap& map, uint32_t flags) {
  lwo_checkpoint_pool_config config = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  config.flags = flags;
  if (!map.names.empty()) {
    map.name_ptrs.clear();
    map.n_names.clear();
    for (const auto& layer : map.names) {
      map.n_names.push_back(static_cast<uint32_t>(layer.size()));
      for (const std::string& n : layer) map.name_ptrs.push_back(n.c_str());
    }
    config.names = map.name_ptrs.data();
    config.n_names = map.n_names.data();
    config.n_layers = static_cast<uint32_t>(map.names.size());
  } else if (map.patterns.size() == 1) {
    config.pattern = map.patterns[0].c_str();
  } else {
    map.pattern_ptrs.clear();
    for (const std::string& p : map.patterns) map.pattern_ptrs.push_back(p.c_str());
    config.patterns = map.pattern_ptrs.data();
    config.n_patterns = static_cast<uint32_t>(map.patterns.size());
  }
  return config;
}

bool map_checkpoint(lwo_checkpoint* checkpoint, const std::vector<CkptTensor>& tensors,
                    const CkptSpec& spec, uint32_t flags, const std::string& hint, CkptMap* map) {
  *map = CkptMap{};
  if (!spec.names_file.empty()) {
    map->names_file = spec.names_file;
    map->names = read_names_file(spec.names_file);
  } else if (!spec.patterns.empty()) {
    map->patterns = spec.patterns;
  } else {
    for (const char* p : kDefaultPatterns)
      if (map->patterns.empty() && maps_any(tensors, p)) map->patterns = {p};
    if (map->patterns.empty()) return false;
    map->is_default = true;
  }

  // The library maps: it rejects a bad pattern, a missing name or layer
  // index, and says which layer each tensor is in (tensors in file order).
  const lwo_checkpoint_pool_config config = checkpoint_pool_config(*map, flags);
  std::vector<uint32_t> layer(tensors.size(), LWO_NO_LAYER);
  uint32_t n_layers = 0;
  lwo_status_t s = lwo_checkpoint_map_tensors(checkpoint, &config,
                                              static_cast<uint32_t>(tensors.size()), layer.data(),
                                              nullptr, &n_layers);
  // A pattern or name list that does not fit the checkpoint is the command
  // line's fault: a usage error.
  if (LWO_STATUS_CLASS(s) == LWO_STATUS_CLASS_ARGUMENT)
    throw UsageError(strf("%s (%s)", lwo_last_error_message(), lwo_status_string(s)), hint);
  check(s, "lwo_checkpoint_map_tensors");
  map->layers.resize(n_layers);
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    if (layer[i] == LWO_NO_LAYER)
      map->unmatched.push_back(i);
    else if (layer[i] < n_layers)
      map->layers[layer[i]].push_back(i);
    else
      fail(strf("internal: lwo_checkpoint_map_tensors put tensor %u in layer %u of %u; please "
                "report this",
                i, layer[i], n_layers));
  }
  for (uint32_t l = 0; l < n_layers; ++l)
    if (map->layers[l].empty()) map->gaps.push_back(l);
  return true;
}

}  // namespace cli
