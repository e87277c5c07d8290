// Checkpoint helpers shared by lwo info and lwo run --weights: opening a
// safetensors checkpoint, reading its tensor list, and mapping tensors to
// layers by a name pattern (given, or the first default that maps a tensor).
#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace cli {

const char* const kDefaultPatterns[] = {"model.layers.{i}.", "blocks.{i}.", "layers.{i}.", "h.{i}.",
                                        "transformer.h.{i}."};
const size_t kNumDefaultPatterns = sizeof(kDefaultPatterns) / sizeof(kDefaultPatterns[0]);

std::string default_patterns_text() {
  std::string s;
  for (size_t i = 0; i < kNumDefaultPatterns; ++i)
    s += (i ? ", \"" : "\"") + std::string(kDefaultPatterns[i]) + "\"";
  return s;
}

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void open_checkpoint(const std::string& path, Checkpoint& checkpoint) {
  check(lwo_checkpoint_open(path.c_str(), checkpoint.out()), "lwo_checkpoint_open");
}

std::vector<CkptTensor> checkpoint_tensors(lwo_checkpoint* checkpoint) {
  uint32_t n = 0;
  CHECK(lwo_checkpoint_tensor_count(checkpoint, &n));
  std::vector<CkptTensor> out(n);
  for (uint32_t i = 0; i < n; ++i) {
    lwo_checkpoint_tensor info{};
    info.size = sizeof info;
    CHECK(lwo_checkpoint_tensor_info(checkpoint, i, &info));
    CkptTensor& t = out[i];
    t.name = info.name ? info.name : "";
    t.dtype_name = info.dtype_name ? info.dtype_name : "?";
    t.dtype = info.dtype;
    t.n_dims = info.n_dims;
    t.shape.assign(info.shape, info.shape + std::min<int32_t>(std::max(info.n_dims, 0), LWO_MAX_DIMS));
    t.bytes = info.bytes;
    t.offset = info.file_offset;
    t.file = info.file;
  }
  return out;
}

std::string shape_text(const CkptTensor& t) {
  std::string s = "[";
  for (size_t d = 0; d < t.shape.size(); ++d)
    s += (d ? ", " : "") + std::to_string(static_cast<long long>(t.shape[d]));
  if (t.n_dims > static_cast<int32_t>(t.shape.size())) s += ", ...";
  return s + "]";
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

lwo_checkpoint_pool_config checkpoint_pool_config(const CkptMap& map, uint32_t flags) {
  lwo_checkpoint_pool_config config = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  config.pattern = map.pattern.c_str();
  config.flags = flags;
  return config;
}

bool map_checkpoint(lwo_checkpoint* checkpoint, const std::vector<CkptTensor>& tensors,
                    const std::string& pattern, CkptMap* map) {
  *map = CkptMap{};
  if (pattern.empty()) {
    for (size_t i = 0; i < kNumDefaultPatterns && map->pattern.empty(); ++i)
      if (maps_any(tensors, kDefaultPatterns[i])) map->pattern = kDefaultPatterns[i];
    if (map->pattern.empty()) return false;
    map->is_default = true;
  } else {
    map->pattern = pattern;
  }

  // The library maps: it rejects a bad pattern or a missing layer index, and
  // says which layer each tensor is in (tensors in file order).
  const lwo_checkpoint_pool_config config = checkpoint_pool_config(*map, 0);
  std::vector<uint32_t> layer(tensors.size(), LWO_NO_LAYER);
  uint32_t n_layers = 0;
  check(lwo_checkpoint_map_tensors(checkpoint, &config, static_cast<uint32_t>(tensors.size()),
                                   layer.data(), nullptr, &n_layers),
        strf("lwo_checkpoint_map_tensors(pattern \"%s\")", map->pattern.c_str()).c_str());
  map->layers.resize(n_layers);
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    if (layer[i] == LWO_NO_LAYER)
      map->unmatched.push_back(i);
    else
      map->layers[layer[i]].push_back(i);
  }
  return true;
}

}  // namespace cli
